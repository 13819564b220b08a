"""The shared types of an execution: where a run goes, what it runs, and the program cache.

Both program builders (the replicated step loop in `trainer.py` and the
pipelined executor in `pipelined/`) produce a `Run`; the trainer and the
reports read it. The cache keeps one `Run` per mode on the model's host state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from keras_ipu.device import system as ipu_system
from keras_ipu.device.program import ExecutionProgram
from keras_ipu.device.replicate import Replicas
from keras_ipu.keras import context, feed_options, options

MODES = ("fit", "evaluate", "predict")

# Flags of the configured system that a program reads when it compiles: a
# system configured again with others compiles the model's programs again.
_COMPILE_FLAGS = ("xla_compiler_options", "background_loop_compile")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run goes: its replicas, and the stage plan of a pipelined model.

    Args:
        replicas: The replicas (one IPU each, the first IPU of a pipeline).
        plan: The model's `PipelinePlan`, or `None` when it is not pipelined.
        device_mapping: The IPU of each pipeline stage (empty when not pipelined).

    Example:

    >>> Placement(Replicas(system.ipus[:2])).replicas.count
    2
    """

    replicas: Replicas
    plan: Any = None
    device_mapping: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Run:
    """What one fit/evaluate/predict call runs.

    Args:
        program: The compiled execution program.
        layout: Regroups host batches for the program (`to_program`) and
            its outfeed; a `replication.Layout` or a pipelined layout.
        codec: Moves the Keras state to and from the program's device state.
        replica_count: The replication factor.
        batches_per_step: Batches one program step consumes, when its
            outputs have a leading axis of that many batches (gradient
            accumulation); `None` when a step is one batch without one.
        split_steps: For programs that return every step's outputs with
            the execution instead of streaming them (asynchronous
            callbacks): `outfeed -> (outfeed as without them, per-step
            outputs [steps, replicas, ...])`.
        accumulated_logs: Whether the outfeed's logs are the means a pipeline
            accumulates over each pass (`accumulate_outfeed`): they are the
            epoch's logs then, not the metrics' running state.

    Example:

    >>> state, outfeed = run.program(state, run.codec.place(run.layout.to_program(batches)))
    """

    program: ExecutionProgram
    layout: Any
    codec: Any
    replica_count: int
    batches_per_step: int | None = None
    split_steps: Callable[[Any], tuple[Any, Any]] | None = None
    accumulated_logs: bool = False


def cached_run(model: Any, mode: str, key: Any, build: Callable[[], Run]) -> Run:
    """The model's run for `mode`: the cached one when its key matches, else `build()`.

    Args:
        model: The Keras model.
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        key: What identifies the program (hashable, compared with `==`).
        build: Makes a new `Run` when the cached one does not match.

    Returns:
        The `Run`.

    Example:

    >>> run = cached_run(model, "fit", key, build)
    """
    programs = context.state_of(model).programs
    configured = ipu_system.require()
    key = (key, tuple(configured.option(flag) for flag in _COMPILE_FLAGS))
    known_key, run = programs.get(mode, (None, None))
    if run is None or known_key != key:
        run = build()
        programs[mode] = (key, run)
    return run


def entry(model: Any, mode: str) -> tuple | None:
    """The model's cached `(key, run)` for a mode, or `None`, to restore with `restore_entry`.

    Example:

    >>> previous = entry(model, "fit")
    """
    return context.state_of(model).programs.get(mode)


def restore_entry(model: Any, mode: str, previous: tuple | None) -> None:
    """Puts back what `entry` returned: the run a failed compilation replaced.

    Example:

    >>> restore_entry(model, "fit", previous)
    """
    programs = context.state_of(model).programs
    if previous is None:
        programs.pop(mode, None)
    else:
        programs[mode] = previous


def run_for(model: Any, mode: str) -> Run | None:
    """The model's last compiled run for a mode, or `None`.

    Example:

    >>> run_for(model, "fit").replica_count
    1
    """
    return context.state_of(model).programs.get(mode, (None, None))[1]


def program_for(model: Any, mode: str) -> ExecutionProgram | None:
    """The model's last compiled program for a mode, or `None`.

    Example:

    >>> program_for(model, "fit").report.ipus[0].memory_bytes
    """
    run = run_for(model, mode)
    return run.program if run is not None else None


def forget_programs(model: Any, recompiled: bool = False) -> None:
    """Drops the model's compiled programs (after `compile` or an option change).

    Args:
        model: The model.
        recompiled: Whether `compile()` dropped them (a run in progress then
            stops on the state the model had when compiled).

    Example:

    >>> forget_programs(model)
    >>> program_for(model, "fit") is None
    True
    """
    state = context.state_of(model)
    state.programs.clear()
    state.compilations += recompiled


def change_options(model: Any, new: options.IPUOptions) -> None:
    """Sets a model's IPU options, dropping its programs only when what they read changes
    (a run in progress then stops at its next execution boundary: `programs.RECOMPILED`);
    only `fit`'s when only the accumulation options change, which the other modes ignore.

    Example:

    >>> change_options(model, options.replication_options(options.options_of(model), "sum"))
    """
    old = options.options_of(model)
    options.set_options(model, new)  # kept as given, also when only the spelling changed
    changed = {field.name for field in dataclasses.fields(new)
               if _differ(_read(field.name, getattr(new, field.name)),
                          _read(field.name, getattr(old, field.name)))}
    if not changed:
        return
    if changed <= _FIT_ONLY_OPTIONS:  # `evaluate` and `predict` ignore accumulation
        context.state_of(model).programs.pop("fit", None)
    else:
        forget_programs(model)


_FIT_ONLY_OPTIONS = frozenset({
    "gradient_accumulation_steps_per_replica", "gradient_accumulation_reduction_method",
    "gradient_accumulation_optimizer_kwargs", "use_v2_gradient_accumulation_optimizer",
    # A pipeline's inference passes `steps_per_execution` micro-batches.
    "pipelining_gradient_accumulation_steps_per_replica"})


# What the programs read of an option, where that is less than its value: the feed
# options' depths (a depth left out is its default; the other keys have no effect).
_READ_BY_PROGRAMS: dict[str, Callable[[Any], Any]] = {
    "infeed_kwargs": feed_options.prefetch_depth,
    "outfeed_kwargs": feed_options.buffer_depth,
}


def _read(name: str, value: Any) -> Any:
    read = _READ_BY_PROGRAMS.get(name)
    return value if read is None else read(value)


def _differ(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (ValueError, TypeError):  # an array among the values (an accepted kwarg's)
        return True
