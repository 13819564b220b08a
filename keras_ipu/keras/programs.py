"""Which compiled program runs a mode's executions, built (or found) before anything runs.

A model without stages runs the replicated step loop: one `ExecutionProgram`
of the mode's step function (`steps.py`), gradient accumulation and the
cross-replica sums inside, finalized to the last step's logs or the
predictions. A pipelined model gets its program from `pipelined`. Programs
are cached per model and key (`run.cached_run`): a second `fit` with the same
settings reuses the compiled one.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_ipu.device import floating_point
from keras_ipu.device import system as ipu_system
from keras_ipu.device.outfeed import StepStream
from keras_ipu.device.program import ExecutionProgram
from keras_ipu.device.replicate import Replicas
from keras_ipu.keras import (
    batch_norm_groups,
    context,
    data,
    feed_options,
    pipelined,
    replication,
    stages,
    steps,
)
from keras_ipu.keras import run as run_module
from keras_ipu.keras.options import IPUOptions, accumulator_dtypes
from keras_ipu.keras.replication import VARIABLES_CHANGED, Layout, ReplicaCodec
from keras_ipu.keras.run import Run, cached_run
from keras_ipu.keras.steps import STATE_PARTS


def check_not_eager(model) -> None:
    """Refuses a model compiled with `run_eagerly=True`: an IPU runs compiled programs only.

    Raises:
        RuntimeError: When the model runs eagerly.

    Example:

    >>> check_not_eager(model)   # compiled with run_eagerly=False: nothing
    """
    if getattr(model, "_run_eagerly", False) or getattr(model, "run_eagerly", False):
        raise RuntimeError(
            "Keras models cannot run eagerly when using `IPUStrategy`. Set "
            "`run_eagerly=False` when calling `compile`."
        )


def prepare(model, mode: str, placement, feed, options: IPUOptions) -> Run:
    """Compiles and measures the mode's program before any state changes.

    Args:
        model: The Keras model (created in an `IPUStrategy`).
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        placement: Where the run goes (replicas, or a pipeline's stage plan).
        feed: The run's data feed (its plan gives `steps_per_execution`).
        options: The model's IPU options.

    Returns:
        The `Run`: the compiled program, its layout and codec.

    Raises:
        IPUOutOfMemoryError: When the program does not fit an IPU.

    Example:

    >>> run = prepare(model, "fit", placement, feed, options_of(model))
    >>> run.program.report.loop
    'scan'
    """
    hardware = ipu_system.require().hardware
    parts = STATE_PARTS[mode]
    if placement.plan is None:
        _check_not_pipelined(model, feed)
    replication.check_instance_programs(model, mode, parts, feed.first_batch(), options,
                                        placement)
    if placement.plan is not None:
        key, build = pipelined.program_for(model, mode, placement, feed, options, hardware)
    else:
        key, build = _replicated_program(model, mode, placement.replicas, options, hardware)
    # Which variables are trainable is part of the program: setting a layer's
    # `trainable` after compile() gives another one, as Keras' jit retraces.
    previous = run_module.entry(model, mode)
    run = cached_run(model, mode, (key, _state_structure(model, parts)), build)
    spe = feed.plan.steps_per_execution
    host_shape = (spe, run.replica_count) if run.replica_count > 1 else (spe,)
    batches = jax.tree_util.tree_map(
        lambda a: np.empty((*host_shape, *np.shape(a)), a.dtype), feed.first_batch()
    )
    batches = run.codec.batch_spec(run.layout.to_program(batches))
    # The state is gathered only when the program compiles for these batches.
    try:
        run.program.prepare(lambda: run.codec.spec(model._get_jax_state(
            **dict.fromkeys(parts, True), purge_model_variables=False)), batches)
    except BaseException:
        # A program that did not compile (out of memory, say) is not the model's last:
        # its report stays the one of the program that last ran.
        run_module.restore_entry(model, mode, previous)
        raise
    return run


def check_unchanged(model, mode: str) -> None:
    """Refuses to go on with the model's run for `mode` once its variables are no longer
    those it was prepared for (a callback froze or unfroze a layer), or once the model
    was compiled again (see `check_current`).

    Raises:
        ValueError: `replication.VARIABLES_CHANGED`.
        RuntimeError: `RECOMPILED`.

    Example:

    >>> check_unchanged(model, "fit")   # in fit's loop, after the callbacks ran
    """
    check_current(model, mode)
    # `cached_run`'s key: ((the program's key, the state structure), the flags).
    prepared = run_module.entry(model, mode)[0][0][1]
    if _state_structure(model, STATE_PARTS[mode]) != prepared:
        raise ValueError(VARIABLES_CHANGED)


RECOMPILED = (
    "The model was compiled again (or an IPU option of it set) while it runs, by a "
    "callback say: the run's program is the one compiled for the model at its start "
    "(its optimizer, loss and metrics), so the run stops here. As in Keras, call "
    "compile() between calls of fit(); the weights are those of the last execution the "
    "run kept (with compile(), those the model had when compiled).")


def check_current(model, mode: str) -> None:
    """Refuses to go on with a run whose programs the model forgot: `compile()` (or an
    option setter) ran since the run was prepared. Cheap: one lookup.

    Args:
        model: The running model.
        mode: The run's mode (`"fit"`, `"evaluate"` or `"predict"`).

    Raises:
        RuntimeError: `RECOMPILED`.

    Example:

    >>> check_current(model, "fit")   # after an execution's asynchronous hooks
    """
    if run_module.entry(model, mode) is None:
        raise RuntimeError(RECOMPILED)


def compilations(model) -> int:
    """How many times `compile()` has dropped the model's programs (see
    `check_not_recompiled`)."""
    return context.state_of(model).compilations


def check_not_recompiled(model, compiled_at: int) -> None:
    """Refuses to keep the state of an execution whose asynchronous hooks called
    `compile()`: the run stops on the state the model had when compiled. After an
    option setter the execution's state is kept; `check_current` stops the run at the
    next execution boundary.

    Args:
        model: The running model.
        compiled_at: `compilations(model)` when the run began.

    Raises:
        RuntimeError: `RECOMPILED`.

    Example:

    >>> check_not_recompiled(model, compiled_at)   # after an execution's asynchronous hooks
    """
    if compilations(model) != compiled_at:
        raise RuntimeError(RECOMPILED)


def _state_structure(model, parts) -> tuple:
    """The variables each part of a mode's state holds: the model's by identity, the
    optimizer's by count (they follow the trainable variables it was built on)."""
    def structure(part):
        if part == "optimizer_variables":
            return len(model.optimizer.variables)
        return tuple(id(v) for v in getattr(model, part))

    return tuple(structure(part) for part in parts)


def _replicated_program(model, mode, replicas: Replicas, options: IPUOptions, hardware):
    """The cache key and builder of a (replicated) step-loop program."""
    micro = options.gradient_accumulation_steps if mode == "fit" else None
    custom = mode == "fit" and overrides(model, "train_step")
    loop = ipu_system.require().option("execution_loop", "auto")
    buffer_depth = feed_options.buffer_depth(options.outfeed_kwargs)
    streamed = options.asynchronous_callbacks
    identical = ipu_system.require().option("identical_replicas", False)
    norm_group = _norm_group(model, mode, replicas)
    checks = floating_point.system_checks()
    # The accumulators' dtypes follow from this option and the trainable
    # variables (by identity in the run's key): worked out only to build.
    key = (mode, replicas, hardware, micro, custom, loop,
           options.gradient_accumulation_reduction_method, options.accumulator_dtype,
           options.replicated_metric_reduction_method, streamed, buffer_depth, identical,
           norm_group, checks)

    def build() -> Run:
        layout = Layout(replicas.count, micro)
        accumulators = (accumulator_dtypes(options.accumulator_dtype, model.trainable_variables)
                        if mode == "fit" and not custom else None)
        program = ExecutionProgram(
            batch_norm_groups.grouped(
                _step_function(model, mode, options, replicas, custom, accumulators),
                norm_group),
            mode=mode,
            replicas=replicas,
            hardware=hardware,
            exchange_bytes_per_step=gradient_bytes(model) if mode == "fit" else 0,
            micro_batches_per_step=micro or 1,
            finalize=_finalize(mode, layout, options, replicas),
            loop=loop,
            stream=StepStream(replicas.count, buffer_depth) if streamed else None,
            # Fit and evaluate executions hand Keras their last batch's logs.
            last_outputs_only=mode != "predict",
            floating_point_checks=checks,
        )
        return Run(program, layout, ReplicaCodec(replicas, STATE_PARTS[mode]), replicas.count,
                   batches_per_step=micro)

    return key, build


def _norm_group(model, mode: str, replicas: Replicas) -> int:
    """The replica group of training batch normalisation: 1 (none) but in a replicated `fit`
    of a model with `BatchNormalization` (its inference uses the moving statistics)."""
    if mode != "fit" or replicas.count == 1:
        return 1
    group = batch_norm_groups.group_size()
    return group if group > 1 and batch_norm_groups.has_batch_norm(model) else 1


def _finalize(mode: str, layout: Layout, options: IPUOptions, replicas: Replicas):
    """What the program returns of its outfeed: last logs, or predictions in order.

    Across instances the outfeed is made whole on every device, so that each
    instance reads it; predictions stay per replica (`local_predictions`).
    """
    if replicas.spans_processes:
        everywhere = NamedSharding(replicas.mesh, P())
        if mode == "predict":
            return lambda outfeed: jax.lax.with_sharding_constraint(outfeed, everywhere)
        reduction = options.replicated_metric_reduction_method
        return lambda outfeed: jax.lax.with_sharding_constraint(
            layout.last_logs(outfeed, reduction), everywhere)
    if mode == "predict":
        return layout.predictions
    reduction = options.replicated_metric_reduction_method
    return lambda outfeed: layout.last_logs(outfeed, reduction)


def _step_function(model, mode: str, options: IPUOptions, replicas: Replicas, custom: bool,
                   accumulators: tuple[str, ...] | None):
    step = _one_replicas_step(model, mode, options, replicas, custom, accumulators)
    if replicas.count > 1 and not ipu_system.require().option("identical_replicas", False):
        return steps.distinct_random_streams(model, step)
    return step


def _one_replicas_step(model, mode: str, options: IPUOptions, replicas: Replicas,
                       custom: bool, accumulators: tuple[str, ...] | None):
    if mode == "evaluate":
        return steps.test_step(model)
    if mode == "predict":
        return steps.predict_step(model)
    if custom:
        return steps.keras_train_step(model)
    # Callbacks that see every batch need every micro-batch's logs; else the
    # last's come from the metrics' final state, when Keras works them out so.
    own_logs = not any(overrides(model, name) for name in ("compute_metrics",
                                                          "get_metrics_result"))
    return steps.train_step(
        model,
        micro_batches=options.gradient_accumulation_steps,
        reduction=options.gradient_accumulation_reduction_method,
        accumulator_dtypes=accumulators,
        replicas=replicas,
        every_micro_batch_logs=options.asynchronous_callbacks or not own_logs,
    )


def _check_not_pipelined(model, feed) -> None:
    """Refuses a subclassed model that its first batch showed to be pipelined.

    Whether a subclassed model enters `PipelineStage` scopes shows only when
    it is traced: with arrays keras_ipu traces it before it places the run,
    but other data (a generator, a `PyDataset`, a data frame) is read only
    to build the model, after the run was placed on replicas.
    """
    if isinstance(feed, data.ArrayFeed) or stages.model_kind(model) != stages.MODEL:
        return
    if pipelined.plan_of(model) is not None:
        raise RuntimeError(
            f"Model {model.name} enters `PipelineStage` scopes, but it was not built when "
            f"this run started: keras_ipu places a run before it reads data that is not "
            f"arrays, so the model would have run unpipelined. Build it first "
            f"(`model.build(input_shape)`, or call it on a batch) and run it again.")


# The methods a pipelined model runs as keras_ipu's own, per mode: the stages
# are the graph's layer calls, and the step is the schedule's.
_PIPELINED_OWN = {"fit": ("call", "train_step"), "evaluate": ("call", "test_step"),
                  "predict": ("call", "predict_step")}


def check_pipelined_overrides(model, mode: str, plan) -> None:
    """Refuses, as the reference, overrides a pipelined model would silently ignore.

    A pipelined model's stages are its graph's layer calls and its step the
    schedule's: an override of a Functional or Sequential model's `call`, or
    of the mode's step, cannot run.

    Args:
        model: The model.
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        plan: Its pipeline plan (None when it is not pipelined: nothing to check).

    Raises:
        RuntimeError: Naming the overridden function.

    Example:

    >>> check_pipelined_overrides(model, "predict", placement.plan)
    """
    if plan is None:
        return
    for name in _PIPELINED_OWN[mode]:
        if overrides(model, name):
            raise RuntimeError(
                f"The function `{name}` for the model {model.name} has been overridden. "
                f"This is not supported for pipelined Keras models.")


def overrides(model, name: str) -> bool:
    """Whether the model's class overrides Keras' JAX trainer method `name` (or a graph
    model's `call`).

    Example:

    >>> overrides(model, "train_step")
    False
    """
    from keras.src.backend.jax.trainer import JAXTrainer
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    base = type(model)._ipu_base_class
    if name == "call":  # only a graph model's call is Keras' own (a subclassed one's is its)
        own = next((c for c in (Sequential, Functional) if issubclass(base, c)), None)
        return own is not None and base.call is not own.call
    return getattr(base, name) is not getattr(JAXTrainer, name)


def gradient_bytes(model) -> int:
    """Bytes of the model's gradients: what each replica all-reduces per step.

    Example:

    >>> gradient_bytes(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    40
    """
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in model.trainable_variables)
