"""Pipelined training with the host walking the schedule table.

The same training as `pipelined.training` (the same stage functions, stash,
gradient accumulation and optimizer clones), strung together differently:
each stage op is its own program, compiled once for its IPU's device, and
the host dispatches the ops of each tick of the schedule table to their IPUs
without waiting for them (JAX dispatches asynchronously: the IPUs work at
the same time, each in table order). Activations and their gradients go from
IPU to IPU as device-to-device copies; what a forward op stashes for its
backward op stays on its IPU in between. The last stage's forward op and its
backward op on the same micro-batch run as one op: nothing from another IPU
comes between them.

`loops.choose_pipeline_loop` picks this form (on CPUs, for convolutional
stages, whose schedule program is slow to compile); unreplicated pipelines.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from keras_ipu.device import (
    accounting,
    attachment,
    compiler,
    convolutions,
    loops,
    lowering,
    precision,
    schedules,
)
from keras_ipu.device.dispatch import DispatchedExecutable
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod as Reduction
from keras_ipu.keras.pipelined import codec, training, update
from keras_ipu.keras.pipelined.model import (
    TRAINING_STATE_PARTS,
    PipelinedModel,
    PipelineState,
)
from keras_ipu.keras.steps import ACCUMULATE, ACCUMULATE_SHARED

TRAINABLE, NON_TRAINABLE, OPTIMIZER, METRICS = TRAINING_STATE_PARTS


def _local(flats: dict) -> dict:
    """An IPU's flats `[1, 1, length]` (its slot of the packed state) as vectors."""
    return {dtype: a[0, 0] for dtype, a in flats.items()}


def _slot(flats: dict) -> dict:
    """The inverse of `_local`."""
    return {dtype: a[None, None] for dtype, a in flats.items()}


def _on(tree: Any, device: jax.Device) -> Any:
    """Shape structs of `tree`'s leaves, placed on `device`."""
    sharding = SingleDeviceSharding(device)
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _trace(fn, args, device: jax.Device, donate=()):
    """`jax.jit(fn).trace` on `device`, with XLA:CPU's fast convolution layout on CPUs."""
    return convolutions.trace_for(device.platform, jax.jit(fn, donate_argnums=donate),
                                  *_on(args, device))


@dataclasses.dataclass
class _Ops:
    """The compiled ops of one input signature, and what each stage stashes.

    `forward[s]` for every stage but the last, `backward[s]` likewise, `last`
    (the last stage's fused op), `update[ipu]` (optimizer, fresh accumulator),
    `summary[ipu]` (what the optimizer steps need of its gradients:
    `update.gradient_summary`; only with a `LossScaleOptimizer` or
    `global_clipnorm`).
    """

    forward: list
    backward: list
    last: Any
    update: list
    stash_bytes: list[int]
    summary: list = dataclasses.field(default_factory=list)


class DispatchedFit:
    """A pipelined training execution as per-op programs the host dispatches.

    Args:
        pipelined: The model's stages and their IPUs.
        state: The packed state layout (one replica).
        table: The training schedule table of one weight update.
        reduction: How micro-batch gradients combine.
        accumulators: Per variable dtype, the dtype its gradients accumulate in.
        recompute: Backward ops recompute their stage's forward pass instead
            of taking its stashed activations.
        checkpoints: Forward ops stash only their stage's recomputation
            checkpoints, from which backward ops recompute the rest.

    Example:

    >>> fit = DispatchedFit(pipe, state, table, Reduction.MEAN, {"float32": "float32"})
    >>> fit.choose(state_spec, batches_spec, "cpu", "auto").form
    'host'
    >>> state, logs = fit.compile(state_spec, batches_spec)().run(state, batches)
    """

    def __init__(self, pipelined: PipelinedModel, state: PipelineState,
                 table: schedules.ScheduleTable, reduction: Reduction,
                 accumulators: Mapping[str, str], recompute: bool = False,
                 checkpoints: bool = False):
        if state.replicas != 1:
            raise ValueError("A dispatched pipeline runs one replica; "
                             f"this state has {state.replicas}.")
        self.p, self.state, self.table, self.recompute = pipelined, state, table, recompute
        self.stages = training.Stages(pipelined, state, checkpoints)
        self.accumulate, self.accumulators = ACCUMULATE[reduction], dict(accumulators)
        self.rules = (self.accumulate, ACCUMULATE_SHARED[reduction])
        self.micro, self.last = table.num_micro_batches, pipelined.num_stages - 1
        self.devices = [state.mesh.devices[0, i] for i in range(pipelined.num_ipus)]
        # The stages' forward ops traced per micro-batch signature: the loop
        # rule reads them, and compiling starts from them.
        self._forward_traces: dict[Any, list] = {}

    # ------------------------------------------------------------------ the ops

    def _stage(self, s: int, tv, ntv, metrics, bundle, batch):
        ipu = self.p.device_mapping[s]
        weights = self.stages.runner.trainable(ipu, _local(tv))
        return self.stages.for_vjp(s, weights, _local(ntv), metrics, bundle, batch)

    def _accumulated(self, s: int, acc, grads, j):
        return self.stages.accumulated(s, acc, grads, j, self.micro, self.rules)

    def _packed_ntv(self, s: int, ntv: dict) -> dict:
        return _slot(self.stages.runner.pack_non_trainable(self.p.device_mapping[s], ntv))

    def forward_op(self, s: int):
        """`(tv, ntv, bundle, batch) -> (ntv, message, stashed)` of a stage but the last."""

        def op(tv, ntv, bundle, batch):
            f, weights, known, values = self._stage(s, tv, ntv, None, bundle, batch)
            if self.recompute:
                out, aux = f(weights, bundle)
                return self._packed_ntv(s, aux[0]), out, []
            out, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
            kept = training.kept_residuals(vjp_fn, aux, known, values)[0]
            return self._packed_ntv(s, aux[0]), out, kept

        op.__name__ = f"forward_stage_{s}"  # names the program in logs and profiles
        return op

    def backward_op(self, s: int):
        """`(tv, ntv, bundle, batch, gradient, stashed, acc, j) -> (message, acc)`."""

        def op(tv, ntv, bundle, batch, gradient, kept, acc, j):
            f, weights, known, values = self._stage(s, tv, ntv, None, bundle, batch)
            # Traced for the pullback's structure: XLA drops the forward
            # computation when the residuals come from the stash.
            _, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
            if not self.recompute:
                _, treedef, source, known = training.kept_residuals(vjp_fn, aux, known, values)
                vjp_fn = training.join_residuals(treedef, source, kept, known)
            grads, g_in = vjp_fn(gradient)
            return (g_in if s else None), self._accumulated(s, acc, grads, j)

        op.__name__ = f"backward_stage_{s}"
        return op

    def last_op(self):
        """`(tv, ntv, metrics, optimizer, bundle, batch, acc, j) -> (ntv, metrics, logs, message,
        acc)`; the optimizer's variables give the loss scale."""
        s = self.last

        def op(tv, ntv, metrics, optimizer_vars, bundle, batch, acc, j):
            f, weights, _, _ = self._stage(s, tv, ntv, _local(metrics), bundle, batch)
            loss, vjp_fn, (new_ntv, logs, new_metrics) = jax.vjp(f, weights, bundle,
                                                                 has_aux=True)
            scale = update.loss_scale(self.p, self.state, _local(optimizer_vars))
            grads, g_in = vjp_fn(training.loss_cotangent(loss, scale))
            return (self._packed_ntv(s, new_ntv), _slot(new_metrics), logs,
                    (g_in if s else None), self._accumulated(s, acc, grads, j))

        op.__name__ = f"forward_backward_stage_{s}"
        return op

    def update_op(self, ipu: int):
        """`(tv, optimizer, acc, summaries) -> (tv, optimizer, zeroed acc)`: an optimizer step.

        `summaries`: every IPU's `summary_op` of its gradients (an empty tuple
        when the optimizer needs none): with a `LossScaleOptimizer` the
        update is skipped on every IPU unless all are finite
        (`update.skipped_unless`); with `global_clipnorm` the gradients are
        clipped by their norm over every IPU.
        """
        apply = update.optimizer_update(self.p, self.state, self.stages.grads, ipu)

        def op(tv, optimizer_vars, acc, summaries):
            finite, squared = update.combine_summaries(self.p, summaries)
            if finite is not None:
                acc = update.skipped_unless(finite, acc)
            tv, optimizer_vars = apply(_local(tv), _local(optimizer_vars), acc, squared, finite)
            return _slot(tv), _slot(optimizer_vars), self.stages.grads.zeros(self.accumulators)

        op.__name__ = f"optimizer_ipu_{ipu}"
        return op

    def summary_op(self, ipu: int):
        """`acc -> summary`: what the optimizer steps need of an IPU's gradients."""

        def op(acc):
            return update.gradient_summary(self.p, acc)

        op.__name__ = f"gradient_summary_ipu_{ipu}"
        return op

    # ------------------------------------------------------------------ tracing and compiling

    def _specs(self, state, batches):
        """Per part, per IPU, the IPU's slot; one micro-batch; a stage input; `j`; `acc`."""
        local = {part: [{dtype: jax.ShapeDtypeStruct((1, 1, a.shape[2]), a.dtype)
                         for dtype, a in state[part].items()} for _ in self.devices]
                 for part in TRAINING_STATE_PARTS}
        batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[3:], a.dtype),
                                       batches)
        bundle = self.p.bundle(batch[0])
        acc = jax.eval_shape(lambda: self.stages.grads.zeros(self.accumulators))
        return local, batch, bundle, jax.ShapeDtypeStruct((), jnp.int32), acc

    def _traced_forward(self, state, batches) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(batches)
        key = treedef, tuple((leaf.shape[3:], str(leaf.dtype)) for leaf in leaves)
        if key not in self._forward_traces:
            local, batch, bundle, _, _ = self._specs(state, batches)
            forward = []
            for s in range(self.last):
                ipu = self.p.device_mapping[s]
                args = (local[TRAINABLE][ipu], local[NON_TRAINABLE][ipu], bundle, batch)
                # Recomputing, the backward op needs the non-trainable values it was given.
                donate = () if self.recompute else (1,)
                forward.append(_trace(self.forward_op(s), args, self.devices[ipu], donate))
            self._forward_traces[key] = forward
        return self._forward_traces[key]

    def choose(self, state, batches, platform: str, request: str) -> loops.LoopChoice:
        """The loop form by `loops.choose_pipeline_loop` on the stages' forward ops.

        Example:

        >>> fit.choose(state_spec, batches_spec, "cpu", "auto").reason
        """
        forward = self._traced_forward(state, batches)
        return loops.choose_pipeline_loop([t.jaxpr for t in forward], platform, request)

    def compile(self, state, batches) -> Callable[[], DispatchedExecutable]:
        """Traces every op for these inputs and starts compiling them.

        Ops are traced one after the other here (tracing holds Python's
        lock); each compiles on a background thread as soon as it is traced,
        while the next is traced.

        Returns:
            A function that waits for the compilations and returns the
            `DispatchedExecutable` for this signature.
        """
        local, batch, bundle, j, acc = self._specs(state, batches)
        workers = os.cpu_count() or 1
        pool = concurrent.futures.ThreadPoolExecutor(workers)
        platform = self.devices[0].platform
        step_options = compiler.choose_options(compiler.STEP, platform)
        update_options = compiler.choose_options(compiler.OPTIMIZER, platform)

        def started(traced, options=step_options):
            # (Its flops and cycles are the pipeline report's, counted over
            # each stage op as the schedule program's are: nothing is kept to count.)
            lowered = lowering.lower_for(platform, traced)
            compiled = pool.submit(compiler.compile_lowered, lowered, options)
            return compiled, traced.out_info, traced.jaxpr

        forward = [started(traced) for traced in self._traced_forward(state, batches)]
        backward, stash_bytes = [], []
        for s in range(self.last):
            ipu = self.p.device_mapping[s]
            stashed = forward[s][1][2]  # the op's outputs: (ntv, message, stashed)
            stash_bytes.append(accounting.tree_bytes((stashed, bundle)))
            args = (local[TRAINABLE][ipu], local[NON_TRAINABLE][ipu], bundle, batch, bundle,
                    stashed, acc, j)
            backward.append(started(_trace(self.backward_op(s), args, self.devices[ipu],
                                           donate=(6,))))
        ipu = self.p.device_mapping[self.last]
        args = (local[TRAINABLE][ipu], local[NON_TRAINABLE][ipu], local[METRICS][ipu],
                local[OPTIMIZER][ipu], bundle, batch, acc, j)
        last = started(_trace(self.last_op(), args, self.devices[ipu], donate=(1, 2, 6)))
        summary = jax.eval_shape(self.summary_op(0), acc)
        summaries = (summary,) * self.p.num_ipus if summary else ()
        optimizer_steps = [started(_trace(self.update_op(d),
                                          (local[TRAINABLE][d], local[OPTIMIZER][d], acc,
                                           summaries),
                                          self.devices[d], donate=(0, 1, 2)), update_options)
                           for d in range(self.p.num_ipus)]
        summary_ops = [started(_trace(self.summary_op(d), (acc,), self.devices[d]))
                       for d in range(self.p.num_ipus)] if summaries else []
        pool.shutdown(wait=False)

        def executable():
            def compiled(op):
                return op[0].result()

            def memory(op):
                # An IPU keeps 16-bit values in 16 bits, which XLA:CPU does not.
                use = accounting.memory_use(compiled(op), state_bytes=0, io_bytes=0)
                return precision.held_in_16_bits(use, op[2], self.devices[0].platform)

            def each(of):
                return _Ops([of(op) for op in forward], [of(op) for op in backward], of(last),
                            [of(op) for op in optimizer_steps],
                            stash_bytes + [0],  # the fused last op keeps nothing
                            [of(op) for op in summary_ops])

            ops = each(compiled)
            return DispatchedExecutable(
                run=_Runner(self, ops, bundle).run,
                memory=self._memory(each(memory), local, batch, last[1][2]),
                compiler=(f"stage ops: {step_options.describe()}; "
                          f"optimizer steps: {update_options.describe()}"),
            )

        return executable

    def _memory(self, ops: _Ops, local, batch, logs) -> tuple[accounting.MemoryUse, ...]:
        """Per IPU: its state, its largest op's temporaries plus its stash, its io.

        `ops` holds each op's `MemoryUse` (without state or io), as `_Ops`
        holds the compiled ops.
        """
        by_ipu: list[list] = [[] for _ in self.devices]
        stash = [0] * len(self.devices)
        counts = self.table.stash_counts()
        for s in range(self.p.num_stages):
            ipu = self.p.device_mapping[s]
            by_ipu[ipu] += [ops.forward[s], ops.backward[s]] if s < self.last else [ops.last]
            stash[ipu] += counts[s] * ops.stash_bytes[s]
        memory = []
        io = codec.io_by_ipu(self.p.device_mapping, len(self.devices), 1, batch, logs)
        for d, op_uses in enumerate(by_ipu):
            if not op_uses:  # an IPU the device mapping skips: it holds and runs nothing
                memory.append(accounting.MemoryUse(0, 0, 0))
                continue
            uses = [*op_uses, ops.update[d]]
            memory.append(accounting.MemoryUse(
                state_bytes=self.state.own_bytes(d),  # not the padding to the largest IPU
                temporary_bytes=max(u.temporary_bytes for u in uses) + stash[d],
                io_bytes=io[d],
                code_bytes=sum(u.code_bytes for u in uses),
            ))
        return tuple(memory)


class _Runner:
    """Dispatches one execution's ops in table order (see `DispatchedFit`)."""

    def __init__(self, fit: DispatchedFit, ops: _Ops, bundle: jax.ShapeDtypeStruct):
        self.fit, self.ops = fit, ops
        self.mapping, self.devices = fit.p.device_mapping, fit.devices
        # Stage 0's input: no additional losses come before it (never donated).
        self.first_input = jax.device_put(np.zeros(bundle.shape, bundle.dtype),
                                          self.devices[self.mapping[0]])
        self.ticks = [[op for op in tick if op is not None] for tick in fit.table.ticks]
        self.js = [[jax.device_put(np.int32(j), device) for j in range(fit.micro)]
                   for device in self.devices]
        self._acc_spec = jax.eval_shape(lambda: fit.stages.grads.zeros(fit.accumulators))
        # Each update gives back zeroed accumulators: the last one's start the
        # next execution (None while an execution runs, or after one failed).
        self._zeroed: list | None = None

    def _zeros(self) -> list:
        """Empty accumulators on each IPU, copied from the host.

        A program making them would be compiled on the first fit: over a
        slot per variable shape, about half a second per IPU for MobileNetV2.
        """
        return [jax.device_put(attachment.zeros_like(self._acc_spec), device)
                for device in self.devices]

    def run(self, state, batches):
        """One execution: `(packed state, batches) -> (packed state, outfeed)`."""
        fit = self.fit
        local = {part: _split(state[part], len(self.devices)) for part in TRAINING_STATE_PARTS}
        acc, self._zeroed = self._zeroed or self._zeros(), None
        for u in range(jax.tree_util.tree_leaves(batches)[0].shape[0]):
            data = [jax.tree_util.tree_map(lambda a, u=u, j=j: a[u, 0, j], batches)
                    for j in range(fit.micro)]
            logs = _Update(self, local, acc, data).run()
        self._zeroed = acc
        new_state = {part: _joined(state[part], local[part]) for part in TRAINING_STATE_PARTS}
        # The last update's logs, as the schedule program's `[updates, replicas, micro]`.
        outfeed = jax.tree_util.tree_map(lambda *v: jnp.stack(v)[None, None], *logs)
        return new_state, outfeed

    def send(self, value, stage: int):
        """`value` on the IPU of `stage` (a copy when it is another IPU)."""
        device = self.devices[self.mapping[stage]]
        return value if device in value.devices() else jax.device_put(value, device)


class _Update:
    """One weight update: the table's ops, then each IPU's optimizer step.

    Holds the messages in flight (`inbox`: stage inputs, `gradients`: output
    gradients) and the stash, keyed by `(stage, micro-batch)`; `local` (per
    part, per IPU) and `acc` (per IPU) are updated in place.
    """

    def __init__(self, runner: _Runner, local: dict, acc: list, data: list):
        self.runner, self.local, self.acc, self.data = runner, local, acc, data
        self.inbox: dict = {}
        self.gradients: dict = {}
        self.stash: dict = {}
        self.logs: list = [None] * runner.fit.micro

    def run(self) -> list:
        """Dispatches the update; returns its logs per micro-batch."""
        last = self.runner.fit.last
        for tick in self.runner.ticks:
            for op in tick:
                if op.stage == last:
                    if op.phase == "F":  # its backward op runs with it
                        self.last_op(op.micro_batch)
                elif op.phase == "F":
                    self.forward(op.stage, op.micro_batch)
                else:
                    self.backward(op.stage, op.micro_batch)
        tv, opt = self.local[TRAINABLE], self.local[OPTIMIZER]
        ops, devices = self.runner.ops, self.runner.devices
        # Each IPU's gradient summary, copied to every IPU (finiteness for a
        # `LossScaleOptimizer`, the squared norm for `global_clipnorm`).
        summaries = [op(acc) for op, acc in zip(ops.summary, self.acc)]
        for d, step in enumerate(ops.update):
            here = tuple(jax.device_put(summary, devices[d]) for summary in summaries)
            tv[d], opt[d], self.acc[d] = step(tv[d], opt[d], self.acc[d], here)
        return self.logs

    def _input(self, s: int, j: int):
        return self.inbox.pop((s, j)) if s else self.runner.first_input

    def _send_gradient(self, message, s: int, j: int) -> None:
        if s:
            self.gradients[(s - 1, j)] = self.runner.send(message, s - 1)

    def forward(self, s: int, j: int) -> None:
        ipu, (tv, ntv) = self.runner.mapping[s], (self.local[TRAINABLE], self.local[NON_TRAINABLE])
        bundle, found = self._input(s, j), ntv[ipu]
        ntv[ipu], message, kept = self.runner.ops.forward[s](tv[ipu], found, bundle,
                                                             self.data[j])
        # Recomputing, the backward op runs with the non-trainable values this op found:
        # later forward ops move them (a dropout's seed).
        self.stash[(s, j)] = (bundle, kept, found if self.runner.fit.recompute else None)
        self.inbox[(s + 1, j)] = self.runner.send(message, s + 1)

    def backward(self, s: int, j: int) -> None:
        ipu, (tv, ntv) = self.runner.mapping[s], (self.local[TRAINABLE], self.local[NON_TRAINABLE])
        bundle, kept, found = self.stash.pop((s, j))
        message, self.acc[ipu] = self.runner.ops.backward[s](
            tv[ipu], ntv[ipu] if found is None else found, bundle, self.data[j],
            self.gradients.pop((s, j)), kept, self.acc[ipu], self.runner.js[ipu][j])
        self._send_gradient(message, s, j)

    def last_op(self, j: int) -> None:
        s = self.runner.fit.last
        ipu = self.runner.mapping[s]
        tv, ntv, met = (self.local[part] for part in (TRAINABLE, NON_TRAINABLE, METRICS))
        ntv[ipu], met[ipu], self.logs[j], message, self.acc[ipu] = self.runner.ops.last(
            tv[ipu], ntv[ipu], met[ipu], self.local[OPTIMIZER][ipu], self._input(s, j),
            self.data[j], self.acc[ipu], self.runner.js[ipu][j])
        self._send_gradient(message, s, j)


def _split(flats: dict, ipus: int) -> list[dict]:
    """Per IPU, its slot `[1, 1, length]` of each packed array.

    No copies when each IPU has its own device; IPUs that share a device
    hold their slots in one shard, which is sliced.
    """
    per_ipu: list[dict] = [{} for _ in range(ipus)]
    for dtype, array in flats.items():
        for shard in array.addressable_shards:
            start, block = shard.index[1].start or 0, shard.data
            for k in range(block.shape[1]):
                per_ipu[start + k][dtype] = block if block.shape[1] == 1 else block[:, k:k + 1]
    return per_ipu


def _joined(like: dict, per_ipu: list[dict]) -> dict:
    """The packed arrays again, from each IPU's slot (IPUs sharing a device: concatenated)."""
    joined = {}
    for dtype, array in like.items():
        width = array.sharding.shard_shape(array.shape)[1]
        blocks = [[slots[dtype] for slots in per_ipu[i:i + width]]
                  for i in range(0, len(per_ipu), width)]
        joined[dtype] = jax.make_array_from_single_device_arrays(
            array.shape, array.sharding,
            [b[0] if width == 1 else jnp.concatenate(b, axis=1) for b in blocks])
    return joined


__all__ = ["DispatchedFit"]
