"""The trainer's side of pipelining: the plan and its checks, the schedule, the program of a run."""

from __future__ import annotations

import dataclasses
import functools
import graphlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec as P

from keras_ipu.device import (
    accounting,
    checkpoints,
    collectives,
    floating_point,
    processes,
    schedules,
)
from keras_ipu.device import system as ipu_system
from keras_ipu.device.outfeed import StepStream
from keras_ipu.device.program import ExecutionProgram
from keras_ipu.device.replicate import REPLICA_AXIS, Replicas
from keras_ipu.device.report import PipelineReport
from keras_ipu.keras import context, host_data, run, stages
from keras_ipu.keras.layers import RecomputationCheckpoint
from keras_ipu.keras.options import (
    PIPELINING_KWARGS,
    IPUOptions,
    accumulator_dtypes,
    check_stage_poplar_options,
)
from keras_ipu.keras.pipelined import codec, dispatched, optimizer_copies, training
from keras_ipu.keras.pipelined import model as pipelined_model
from keras_ipu.keras.pipelined.loss import stage_loss
from keras_ipu.keras.replication import REPLICA_REDUCTIONS, next_power_of_two
from keras_ipu.keras.stages import graph
from keras_ipu.keras.steps import STATE_PARTS


def plan_of(model, x: Any = None):
    """The model's `PipelinePlan`, or `None` when it is not pipelined.

    Args:
        model: The Keras model.
        x: The data of the call; array-like data gives the input specs used
            to build or trace an unbuilt model.

    Returns:
        The plan, or `None`.

    Raises:
        RuntimeError, ValueError: As `stages.pipeline_plan`.

    Example:

    >>> plan_of(model, x).num_stages
    2
    """
    specs = x if _is_array_like(x) else None
    return stages.pipeline_plan(model, specs)


def _is_array_like(x: Any) -> bool:
    # Only containers are walked: a generator or dataset is one leaf.
    leaves = jax.tree_util.tree_leaves(x, is_leaf=lambda v: not isinstance(v, (tuple, list, dict)))
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                                for leaf in leaves)


def device_mapping(plan, options: IPUOptions, num_ipus: int | None = None) -> tuple[int, ...]:
    """Stage -> IPU: `set_pipelining_options(device_mapping=...)`, else stage i on IPU i.

    Args:
        plan: The model's `PipelinePlan`.
        options: The model's IPU options.
        num_ipus: The IPUs of the model's device, when known: the mapping
            must name only those.

    Raises:
        ValueError: When the mapping does not give one IPU per stage, or
            names an IPU the device does not have.
    """
    mapping = options.pipelining_device_mapping
    if mapping is None:
        return tuple(range(plan.num_stages))
    if len(mapping) != plan.num_stages:
        raise ValueError(
            f"Each stage must be mapped to an IPU: {len(mapping)} mappings != "
            f"{plan.num_stages} stages (`device_mapping` {list(mapping)})."
        )
    if num_ipus is not None and max(mapping) >= num_ipus:
        raise ValueError(
            f"`device_mapping` {list(mapping)} maps a stage to IPU {max(mapping)}, but the "
            f"model's device has {num_ipus} IPUs: map the stages to IPUs 0 to {num_ipus - 1}."
        )
    return tuple(mapping)


def accumulation_steps(model, options: IPUOptions) -> int:
    """Micro-batches per weight update of a pipelined model.

    Optional with the Sequential schedule (as the seed documents), which
    never overlaps stages: without it each batch is one weight update.

    Raises:
        ValueError: When `set_pipelining_options` did not set it for the
            Grouped or Interleaved schedule.
    """
    steps = options.pipelining_gradient_accumulation_steps_per_replica
    if steps is None and schedule_of(options) == schedules.PipelineSchedule.Sequential:
        return 1
    if steps is None:
        raise ValueError(
            "The model which you are attempting to train is pipelined, however "
            "`gradient_accumulation_steps_per_replica` has not been set through "
            "`set_pipelining_options()`. You need to set this value as pipelined models "
            "will perform gradient accumulation when training (it is optional only with "
            "`pipeline_schedule=PipelineSchedule.Sequential`)."
        )
    return steps


def schedule_of(options: IPUOptions) -> schedules.PipelineSchedule:
    """The pipeline schedule of the options (Grouped by default)."""
    return options.pipelining_kwargs.get("pipeline_schedule", schedules.PipelineSchedule.Grouped)


def _check_traced_inputs(model, plan, feed) -> None:
    """Refuses inputs of other shapes than a subclassed model's graph was traced for
    (a `call` that branches on them ran another graph), and batches of another size
    than a graph bound to one (`keras.ops.shape(x)[0]` in a shape, say)."""
    if graph.model_kind(model) != "model":
        return  # a Functional or Sequential graph runs its layers on any batch, as in Keras
    first = feed.first_batch()
    x, _, _ = keras.utils.unpack_x_y_sample_weight(first)
    given = [(None, *np.shape(leaf)[1:]) for leaf in jax.tree_util.tree_leaves(x)]
    traced = [tuple(node.shape) for node in plan.inputs]
    if not all(len(t) == len(g) and all(d in (None, e) for d, e in zip(t[1:], g[1:]))
               for t, g in zip(traced, given)):
        raise ValueError(
            f"The model's graph was traced for inputs of shapes {traced}, and this run's "
            f"are {given}: its `call` may run another graph on them. Build it for them "
            f"(`model.build(...)`), then assign its pipeline stages again.")
    traced_size = graph.traced_batch_size(plan)
    size = host_data.batch_size_of(first)
    if traced_size is not None and size is not None and size != traced_size:
        raise ValueError(
            f"The model's graph was traced for batches of {traced_size} (its `call` needs a "
            f"batch size: `keras.ops.shape(x)[0]` in a shape, say), and this run's batches "
            f"have {size} samples: run it with batches of {traced_size}, build it for {size}, "
            f"or give its reshapes -1 for the batch.")


def program_for(model, mode: str, placement, feed, options: IPUOptions, hardware):
    """The cache key and builder of a pipelined program for a run.

    Raises:
        ValueError: Too few micro-batches for the schedule (naming the minimum), an
            optimizer the pipeline cannot step as Keras does, or per-stage Poplar
            options that do not give one entry per stage.
    """
    plan, mapping, replicas = placement.plan, placement.device_mapping, placement.replicas
    check_stage_poplar_options(options, plan.num_stages, training=mode == "fit")
    _check_traced_inputs(model, plan, feed)
    if mode == "fit" and getattr(model, "optimizer", None) is not None:
        optimizer_copies.check_pipelined(model.optimizer)
        optimizer_copies.check_overwritten(model.trainable_variables)
    schedule = schedule_of(options)
    micro = accumulation_steps(model, options) if mode == "fit" else (
        feed.plan.steps_per_execution)
    minimum = schedules.minimum_micro_batches(schedule, plan.num_stages)
    if micro < minimum and mode != "fit" and (micro < model.steps_per_execution
                                              or not model.compiled):
        # Fewer batches than the schedule fills because the data is shorter than
        # steps_per_execution (cut to fit it, with Keras' warning), or a model never
        # compiled predicts (as Keras' can): inference runs them one after another, to
        # the same values. (Set that small by `compile`, it is refused below.)
        schedule = schedules.PipelineSchedule.Sequential
        minimum = schedules.minimum_micro_batches(schedule, plan.num_stages)
    if micro < minimum:
        what = ("`gradient_accumulation_steps_per_replica`" if mode == "fit"
                else "`steps_per_execution`")
        where = ("`set_pipelining_options`" if mode == "fit"
                 else "`compile(steps_per_execution=...)`")
        raise ValueError(
            f"{what} ({micro}) is too small for the {schedule.name} schedule of "
            f"{plan.num_stages} pipeline stages: the minimum is {minimum} (set it with "
            f"{where})."
        )
    table = schedules.build_schedule(schedule, plan.num_stages, micro, mapping,
                                     training=mode == "fit")
    reduction = options.replicated_metric_reduction_method
    recompute = _recomputation(options)
    if mode == "fit":
        _warn_unused_recomputation_mode(options, recompute)
    keep_checkpoints = recompute and _keeps_checkpoints(options)
    loop = ipu_system.require().option("execution_loop", "auto")
    accumulate_outfeed = bool(options.pipelining_accumulate_outfeed)
    # As in the reference, accumulated logs have no steps to report one by one.
    stepwise = options.asynchronous_callbacks and (mode == "predict" or not accumulate_outfeed)
    # The accumulators' dtypes follow from this option and the trainable variables.
    checks = floating_point.system_checks()
    key = ("pipelined", mode, _plan_key(plan), mapping, replicas, hardware, micro, schedule,
           options.gradient_accumulation_reduction_method, options.pipelined_accumulator_dtype,
           reduction, accumulate_outfeed, recompute, keep_checkpoints, loop, stepwise,
           ipu_system.require().option("identical_replicas", False), checks)

    def build():
        used = max(mapping) + 1
        per_replica = next_power_of_two(used)
        # In a multi-host job: every instance's IPUs, each instance's pipelines
        # in turn (global replica = instance × local replicas + local replica).
        system_ipus = processes.global_ipus(context.device_ipus(model))
        mesh = codec.pipeline_mesh(system_ipus, per_replica, used)
        ipus = tuple(system_ipus[r * per_replica + i]
                     for r in range(replicas.count) for i in range(used))
        pipe = pipelined_model.PipelinedModel(model, plan, mapping, training=mode == "fit")
        state = pipelined_model.PipelineState(pipe, mesh, STATE_PARTS[mode])
        state.set_up(model._get_jax_state(**dict.fromkeys(STATE_PARTS[mode], True)))
        host_form = None
        if mode == "fit":
            # Keeping checkpoints, a stage stashes them as it would its activations.
            training_options = (table, options.gradient_accumulation_reduction_method,
                                dict(_accumulators(model, options)),
                                recompute and not keep_checkpoints,
                                keep_checkpoints)
            execution = training.build_fit_program(pipe, state, *training_options)
            if replicas.count == 1:
                host_form = dispatched.DispatchedFit(pipe, state, *training_options)
        else:
            execution = pipelined_model.build_inference_program(pipe, state, table, mode)
        everywhere = mesh.sharding(P()) if state.spans_processes else None
        layout = codec.PipelineLayout(replicas.count, micro, everywhere)
        # Worked out per executable, for its batches' shapes (another batch size: another
        # executable of this program, and another report).
        cost = _pipeline_cost(pipe, state, table, layout, mode, options)
        finalize = layout.finalize(mode, REPLICA_REDUCTIONS[reduction], accumulate_outfeed)
        if stepwise and mode != "predict":
            finalize = layout.with_steps(finalize)
        # Training streams one weight update per dispatch; an inference pass
        # is the whole execution: its steps come with it.
        streamed = stepwise and mode == "fit"
        program = ExecutionProgram(
            mode=mode,
            replicas=Replicas(ipus),
            hardware=hardware,
            micro_batches_per_step=micro,
            exchange_bytes_per_step=_largest_gradients(pipe) if mode == "fit" else 0,
            finalize=finalize,
            execution=execution,
            pipeline=cost,
            replica_count=replicas.count,
            loop=loop,
            dispatched=host_form,
            stream=StepStream(replicas.count) if streamed else None,
            schedule_reason=_schedule_reason(mode, replicas),
            # Each IPU's own state, not its flats' padding to the largest IPU's; an IPU
            # the device mapping skips holds nothing.
            state_bytes=[state.own_bytes(i) if i in mapping else None
                         for _ in range(replicas.count) for i in range(used)],
            io_split=functools.partial(codec.io_by_ipu, pipe.device_mapping, used,
                                       replicas.count),
            floating_point_checks=checks,
        )
        split_steps = None
        if stepwise and not streamed:
            split_steps = (layout.predictions_by_step(feed.plan.steps_per_execution)
                           if mode == "predict" else tuple)
        return run.Run(program, layout, codec.PipelineCodec(state), replicas.count,
                       batches_per_step=None if mode == "predict" else micro,
                       split_steps=split_steps,
                       accumulated_logs=accumulate_outfeed and mode != "predict")

    return key, build


def _schedule_reason(mode: str, replicas: Replicas) -> str:
    """Why a pipelined execution runs as the compiled schedule program (the report's loop reason).

    The host-dispatched form (`dispatched.DispatchedFit`) runs the ops of one
    replica on this process's IPUs; replicated pipelines sum their gradients
    between replicas inside the schedule program, and across instances a
    process cannot dispatch ops to another instance's IPUs.
    """
    if mode != "fit":
        return "the pipeline schedule is the loop"
    if replicas.spans_processes:
        return ("the pipeline schedule is the loop: its replicas span instances, whose IPUs "
                "this process cannot dispatch to (the host-dispatched form runs one replica)")
    if replicas.count > 1:
        return ("the pipeline schedule is the loop: replicated pipelines sum their gradients "
                "inside it (the host-dispatched form runs one replica)")
    return "the pipeline schedule is the loop"


def _plan_key(plan) -> tuple:
    """What identifies a plan across calls (`pipeline_plan` builds a new object each time)."""
    return tuple(
        (id(call.node), call.stage, call.input_keys, call.output_keys)
        for calls in plan.stages for call in calls
    )


def _largest_gradients(pipe) -> int:
    """Bytes of the gradients of the IPU that holds the most: replicated, each IPU
    sums its stages' gradients with its replicas', side by side with the others."""
    variables = pipe.model.trainable_variables
    return max((accounting.tree_bytes([variables[i] for i in ids]) for ids in pipe.trainable_of),
               default=0)


def _pipeline_cost(pipe, state, table, layout, mode: str, options: IPUOptions):
    """`(hardware, batches) -> (cycles per pass, PipelineReport)` from the counted cost of
    each stage on a micro-batch of the execution's batches (`layout.micro_batch`)."""
    runner = pipelined_model.StageRunner(pipe, state)
    training = mode == "fit"
    recompute = _recomputation(options)
    keep_checkpoints = recompute and _keeps_checkpoints(options)

    def flats(part, ipu):
        # The IPU's own variables, unpadded: the flats every IPU's are padded to (the
        # largest IPU's length) are storage, and their padding no IPU computes with.
        sizes = state.layouts[part][ipu].sizes
        return {dtype: jax.ShapeDtypeStruct((sizes.get(dtype, 0),), dtype)
                for dtype in state.lengths[part]}

    def costs(hardware, batches):
        micro = layout.micro_batch(batches)
        x = micro[0]
        batch = jax.tree_util.tree_leaves(x)[0].shape[0]
        bundle = pipe.bundle(x)
        forward, backward, forward_flops, backward_flops = [], [], [], []
        for s in range(pipe.num_stages):
            ipu = pipe.device_mapping[s]
            # The weights one by one, as an IPU holds them: differentiating with
            # respect to the flat vector that stores them would count, for each
            # weight, an addition over the whole vector to gather the gradients.
            weights = jax.eval_shape(functools.partial(runner.trainable, ipu),
                                     flats("trainable_variables", ipu))
            args = (weights, flats("non_trainable_variables", ipu), bundle, x)

            def stage(t, n, b, x, s=s, ipu=ipu):
                out, _, outputs, _ = runner.run_with(s, t, runner.non_trainable(ipu, n), b, x,
                                                     training)
                # The samples' rows only: the row carrying the additional
                # losses is bookkeeping, not the stage's work.
                return out[:-1] if out is not None else outputs

            backward_stage = None
            if s == pipe.num_stages - 1 and mode != "predict":
                # The last stage computes the loss and the metrics too; its backward op
                # starts from the loss.
                stage, backward_stage = _with_loss(runner, s, ipu, training)
                args = (*args[:3], (micro, flats("metrics_variables", ipu)))
            ahead, behind = _stage_costs(stage, args, s == 0, training, layout.replicas,
                                         backward_stage)
            forward.append(ahead.work_cycles(hardware))
            forward_flops.append(ahead.flops)
            if training:
                # A recomputing backward op runs the stage's forward pass again first.
                again = ahead if recompute else None
                backward.append(behind.work_cycles(hardware)
                                + (again.work_cycles(hardware) if again else 0.0))
                backward_flops.append(behind.flops + (again.flops if again else 0.0))
            else:
                backward.append(0.0)
                backward_flops.append(0.0)
        per_pass = (table.total_cycles(forward, backward if training else None)
                    + table.num_ticks * hardware.sync_cycles)
        report = PipelineReport(
            schedule=table.schedule.name,
            num_stages=pipe.num_stages,
            micro_batches=table.num_micro_batches,
            device_mapping=pipe.device_mapping,
            stage_forward_cycles=tuple(forward),
            stage_backward_cycles=tuple(backward),
            utilisation=table.utilisation(forward, backward if training else None),
            stash_counts=table.stash_counts(),
            ticks=table.num_ticks,
            stash_bytes=tuple(
                count * (batch * _stashed_bytes(pipe, s, x, recompute, keep_checkpoints)
                         + (_non_trainable_bytes(pipe, s)
                            if recompute and not keep_checkpoints else 0))
                for s, count in enumerate(table.stash_counts())
            ),
            recomputation=recompute,
            sync_cycles=hardware.sync_cycles,
            stage_forward_flops=tuple(forward_flops),
            stage_backward_flops=tuple(backward_flops),
            ignored_options=tuple(sorted(
                key for key in options.pipelining_kwargs
                if "no effect" in PIPELINING_KWARGS[key])),
        )
        return per_pass, report

    return _traced_as_built(pipe.model, costs)


def _traced_as_built(model, costs):
    """`costs`, tracing the stages with the trainable flags the model had when it was built.

    The report is worked out when first read: a layer frozen since (a fine-tuning
    step after `fit`) would change the variables the stages were planned with.
    """
    layers = _holders_first(model)
    variables = list(model.variables)

    def flags():
        return [layer.trainable for layer in layers], [v.trainable for v in variables]

    def set_flags(flagged):
        # Setting a layer's flag sets those of the layers and variables it holds: each
        # is set after all that hold it (a shared layer after the layers that call it).
        for layer, flag in zip(layers, flagged[0]):
            layer.trainable = flag
        for variable, flag in zip(variables, flagged[1]):
            variable.trainable = flag

    built = flags()

    def as_built(hardware, batches):
        now = flags()
        set_flags(built)
        try:
            return costs(hardware, batches)
        finally:
            set_flags(now)

    return as_built


def _holders_first(model) -> list:
    """The model and its layers, each after every layer that holds it."""
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    position = {id(layer): i for i, layer in enumerate(layers)}
    holders: dict[int, set[int]] = {i: set() for i in range(len(layers))}
    for i, layer in enumerate(layers):
        for inner in layer._flatten_layers(include_self=False, recursive=False):
            holders[position[id(inner)]].add(i)
    return [layers[i] for i in graphlib.TopologicalSorter(holders).static_order()]


def _recomputation(options: IPUOptions) -> bool:
    """Whether stages recompute their activations in the backward pass (as modelled).

    `IPUConfig.allow_recompute` turns recomputation on; `recomputation_mode`
    chooses how and, as on the IPU, applies only then.
    """
    return ipu_system.require().recomputes


def _warn_unused_recomputation_mode(options: IPUOptions, recompute: bool) -> None:
    if not recompute and options.pipelining_kwargs.get("recomputation_mode") is not None:
        warnings.warn(
            "`recomputation_mode` has no effect while recomputation is off: turn it on "
            "with `IPUConfig.allow_recompute = True` (or `ipu.utils.set_recomputation_options`).",
            stacklevel=2)


def _accumulators(model, options: IPUOptions) -> tuple[tuple[str, str], ...]:
    """Per variable dtype, the dtype a pipeline accumulates those variables' gradients in.

    An IPU holds its gradients in one vector per variable dtype, so the
    variables of one dtype accumulate in one type.

    Raises:
        ValueError: When a per-variable accumulator function gives variables
            of one dtype different accumulator dtypes.
    """
    variables = model.trainable_variables
    chosen: dict[str, str] = {}
    for variable, dtype in zip(variables, accumulator_dtypes(options.pipelined_accumulator_dtype,
                                                             variables)):
        # The types JAX holds them in (float64 is float32 without x64), as the layouts.
        kind = str(jax.dtypes.canonicalize_dtype(variable.dtype))
        dtype = str(jax.dtypes.canonicalize_dtype(dtype))
        if chosen.setdefault(kind, dtype) != dtype:
            raise ValueError(
                f"A pipelined model accumulates the gradients of all its {kind} variables in "
                f"one dtype; the accumulator dtype function gives {chosen[kind]} for some and "
                f"{dtype} for {variable.path!r}.")
    return tuple(sorted(chosen.items()))


def _keeps_checkpoints(options: IPUOptions) -> bool:
    """Whether recomputing stages start from their recomputation checkpoints."""
    mode = options.pipelining_kwargs.get("recomputation_mode", schedules.RecomputationMode.Auto)
    return checkpoints.keeps_checkpoints(mode, schedule_of(options))


def _non_trainable_bytes(pipe, stage: int) -> int:
    """Bytes of the non-trainable values a recomputing stage's forward op stashes (per op)."""
    variables = pipe.model.non_trainable_variables
    ipu = pipe.device_mapping[stage]
    return sum(int(np.prod(variables[i].shape)) * jnp.dtype(variables[i].dtype).itemsize
               for i in pipe.non_trainable_of[ipu])


def _stashed_bytes(pipe, stage: int, x, recompute: bool, keep_checkpoints: bool = False) -> int:
    """Bytes per sample a stage keeps for its backward pass, each tensor in its dtype.

    With recomputation only its input (the tensors it receives, in the bundle's
    type, or the model inputs for the first stage), and its `RecomputationCheckpoint`
    layers' outputs when it keeps checkpoints (per op it also keeps the
    non-trainable values it ran with, `_non_trainable_bytes`); without, also every activation
    its layer calls produce (16-bit ones in 16 bits, under a mixed precision
    policy).
    """
    # What a stage receives travels in the bundle's type.
    kept = (_tensor_bytes(pipe, x, pipe.bundle_in[stage], pipe.bundle(x).dtype.itemsize) if stage
            else _input_bytes(x))
    calls = pipe.plan.stages[stage]
    if recompute:
        checkpointed = [call for call in calls
                        if keep_checkpoints and isinstance(call.operation, RecomputationCheckpoint)]
        return kept + sum(_tensor_bytes(pipe, x, call.output_keys) for call in checkpointed)
    return kept + sum(_tensor_bytes(pipe, x, call.output_keys) for call in calls)


def _tensor_bytes(pipe, x, keys, itemsize: int | None = None) -> int:
    """Bytes per sample of the plan's tensors named by `keys` (in their dtype, or `itemsize`),
    shaped as for the inputs `x` (an axis the graph leaves `None` has `x`'s length)."""
    found = pipe.samples(x)
    return sum(found[key].values * (itemsize or jnp.dtype(pipe.plan.tensors[key].dtype).itemsize)
               for key in keys)


def _input_bytes(x) -> int:
    """Bytes per sample of the model inputs (what the first stage stashes)."""
    return sum(int(np.prod(leaf.shape[1:])) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(x))


def _with_loss(runner, s: int, ipu: int, training: bool):
    """The last stage with its loss and metrics: `(forward, backward)` functions of
    `(weights, non-trainables, bundle, ((x, y, sample_weight), metrics flats))`, as `stage`
    for the others; `backward` gives the loss alone, which the backward op differentiates."""
    model = runner.p.model
    metrics_layout = runner.state.layouts["metrics_variables"][ipu]

    def loss_and_metrics(t, n, b, data):
        batch, metrics_flats = data
        x, y, sample_weight = batch
        _, _, y_pred, extra = runner.run_with(s, t, runner.non_trainable(ipu, n), b, x,
                                              training)
        if not training and not runner.p.adds_losses(x):
            extra = None  # as the evaluate program: `model.losses` is empty
        metrics = metrics_layout.unpack(metrics_flats)
        loss, metrics = stage_loss(
            model, metrics, batch, y_pred, extra, training=training,
            weights={i: t[i] for i in runner.own_trainable(s)})
        _, metrics = model._update_metrics_variables(metrics, loss, x, y,
                                                     jax.lax.stop_gradient(y_pred),
                                                     sample_weight)
        return loss, metrics

    return loss_and_metrics, lambda *args: loss_and_metrics(*args)[0]


def _stage_costs(stage, args: tuple, first: bool, training: bool, replicas: int,
                 backward_stage=None):
    """A stage op's forward cost and its backward op's (`None` for inference), one replica's.

    A stage is traced alone, outside the pipeline's replicated program. One
    whose layers use a grouped collective (a group of the replicas, which a
    lone replica cannot form) is traced over all the replicas instead, a
    `vmap` axis over every argument, and its counts are divided by them.
    `backward_stage` is what the backward op differentiates, when not `stage`.
    """
    def costs(stage, backward_stage, args):
        ahead = _counted(jax.jit(stage).trace(*args))
        return ahead, (_counted(_backward_trace(backward_stage, args, first)) if training
                       else None)

    backward_stage = backward_stage or stage
    try:
        return costs(stage, backward_stage, args)
    except collectives.ReplicaGroupError:
        if replicas == 1:
            raise
    every, every_backward = (jax.vmap(f, axis_name=REPLICA_AXIS, axis_size=replicas)
                             for f in (stage, backward_stage))
    ahead, behind = costs(every, every_backward, jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((replicas, *a.shape), a.dtype), args))
    return (_per_replica(ahead, replicas),
            None if behind is None else _per_replica(behind, replicas))


def _per_replica(cost: accounting.StepCost, replicas: int) -> accounting.StepCost:
    return dataclasses.replace(cost, **{field.name: getattr(cost, field.name) / replicas
                                        for field in dataclasses.fields(cost)})


def _backward_trace(stage, args: tuple, first: bool):
    """The trace of a stage's backward op alone: the pullback of its forward pass.

    The gradients are those the training step takes: with respect to the
    stage's weights and, but for the first stage, the tensors it receives
    (the first stage's inputs are the model's data). The forward pass's
    residuals are the pullback's inputs, so none of the forward work is
    counted twice, nor subtracted where JAX leaves it out.
    """

    def abstract_pullback(t, n, b, x):
        if first:
            return jax.vjp(lambda t: stage(t, n, b, x), t)[1]
        return jax.vjp(lambda t, b: stage(t, n, b, x), t, b)[1]

    pulled = jax.eval_shape(abstract_pullback, *args)
    cotangent = jax.eval_shape(stage, *args)
    return jax.jit(lambda pull, cotangent: pull(cotangent)).trace(pulled, cotangent)


def _counted(traced) -> accounting.StepCost:
    """A stage op's counted cost (its cycles: 16-bit matrix work at the 16-bit rate)."""
    return accounting.step_cost(traced.lower())


__all__ = ["accumulation_steps", "device_mapping", "plan_of", "program_for", "schedule_of"]
