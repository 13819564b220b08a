"""The pipelined training execution: the schedule table run block by block.

One execution is one compiled program (`jax.jit` of a `shard_map` over the
IPUs of a replica, and over the replicas). Per weight update it walks the
schedule table in blocks of ticks (`ScheduleTable.exchange_blocks`): in a
block every IPU runs its ops back to back, each op chosen by a switch
(forward or backward of one stage on one micro-batch, or nothing); after the
block all IPUs exchange the block's messages (activations forward,
activation gradients backward) in one `all_gather`. The switch is
`IPUMesh.switch`: IPUs that share a device run their own ops only.

A forward op keeps what its backward op needs in a stash: the residuals of
`jax.vjp` of the stage (its activations), without the values the backward op
can take again itself (weights, its input, the micro-batch). With
recomputation (`IPUConfig.allow_recompute`; a `recomputation_mode` chooses how) it
keeps only its input and the non-trainable values it ran with (a dropout's
seed), and the backward op recomputes the stage forward from them. Stash
rows are reused as soon as a micro-batch's backward op has run: a stage
holds at most its `stash_counts()` micro-batches.

One `lax.switch` per block picks what an IPU does in it (its ops of the
block as one branch: the table's distinct per-IPU patterns). The last
stage's forward op and its backward op on the same micro-batch run fused
when they share a block. A backward op adds its stage's weight gradients
into its slices of the IPU's flat accumulator, in place. After an update's
micro-batches, gradients are summed over replicas and each IPU applies its
own optimizer clone to its variables.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from keras_ipu.device import checkpoints, schedules
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod as Reduction
from keras_ipu.keras.pipelined.gradients import GradientLayout
from keras_ipu.keras.pipelined.loss import stage_loss
from keras_ipu.keras.pipelined.model import (
    BACKWARD,
    FORWARD,
    IPU_AXIS,
    REPLICA_AXIS,
    TRAINING_STATE_PARTS,
    FlatLayout,
    PipelinedModel,
    PipelineState,
    StageRunner,
    distinct_replica_streams,
    micro_batch_at,
    padded_lengths,
)
from keras_ipu.keras.pipelined.update import (
    all_finite,
    loss_scale,
    optimizer_update,
    skipped_unless,
    squared_norm,
)
from keras_ipu.keras.steps import ACCUMULATE, ACCUMULATE_SHARED

# Blocks of two ticks halve the exchanges of two-stage pipelines; a block is
# only worth running when it saves more exchanges than the idle ops it pads.
BLOCK_SIZE = 2
MIN_BLOCK_SAVING = 0.25


# --------------------------------------------------------------------------- residuals


def split_residuals(vjp_fn, known) -> tuple[list[Any], Any, tuple[int | None, ...]]:
    """The residuals of a `jax.vjp` pullback that must be stashed.

    Residuals that are one of the `known` values (the weights, the stage
    input, the micro-batch) are left out: the backward op has them.

    Args:
        vjp_fn: The pullback returned by `jax.vjp` (a pytree of residuals).
        known: A pytree of values the backward op can give again.

    Returns:
        `(kept residuals, pullback treedef, source)`: `source[i]` is the
        index of residual `i` in the leaves of `known`, or `None` if kept.
    """
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    known_leaves = jax.tree_util.tree_leaves(known)
    ids = {id(leaf): i for i, leaf in enumerate(known_leaves)}
    source = tuple(ids.get(id(leaf)) for leaf in leaves)
    kept = [leaf for leaf, i in zip(leaves, source) if i is None]
    return kept, treedef, source


def join_residuals(treedef, source, kept, known):
    """The pullback again, from the stashed residuals and the known values."""
    known_leaves = jax.tree_util.tree_leaves(known)
    rest = iter(kept)
    leaves = [known_leaves[i] if i is not None else next(rest) for i in source]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def kept_residuals(vjp_fn, aux, known, ntv):
    """`(kept residuals, treedef, source, known)` of a stage's pullback.

    `known`, `ntv` and `aux` must come from the same `Stages.for_vjp` call
    and `jax.vjp` as `vjp_fn`: residuals are matched to them by identity.
    The non-trainable values the stage leaves unchanged are known too.
    """
    known = (known, [v for i, v in ntv.items() if aux[0][i] is v])
    return (*split_residuals(vjp_fn, known), known)


def _stash_rows(table: schedules.ScheduleTable) -> tuple[np.ndarray, int, int]:
    """(row offset per stage, slots per stage, rows): one scratch row at the end."""
    slots = max(max(table.stash_counts()), 1)
    offsets, seen = [], {}
    for ipu in table.device_mapping:
        offsets.append(seen.get(ipu, 0) * slots)
        seen[ipu] = seen.get(ipu, 0) + 1
    return np.asarray(offsets, np.int32), slots, max(seen.values()) * slots + 1


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """A training table as blocks of ticks: what each IPU runs and receives per block.

    Messages land in one inbox per IPU, `[inbox_rows, *bundle]`: row
    `s * m + j` holds stage `s`'s input for micro-batch `j`, row
    `p * m + s * m + j` the gradient of its output, and the last row
    takes what no IPU waits for.

    Attributes:
        patterns: The distinct per-IPU blocks: per slot `None` (idle) or
            `(phase, stage)`. The phase `"FB"` is the last stage's forward op
            with its backward op on the same micro-batch in the next slot
            (phase `"-"`): they run as one op, which needs no stash.
        pattern_id: `[blocks, ipus]`, each IPU's pattern in each block.
        kinds, stages, micro_batches: `[blocks, slots, ipus]`, each slot's op.
        routes: `[blocks, ipus, routes, 3]`: per receiving IPU, `(sending IPU,
            slot, inbox row)` of the messages it keeps (padded with the spare
            row).
        inbox_rows: Rows of an inbox.
    """

    patterns: list
    pattern_id: np.ndarray
    kinds: np.ndarray
    stages: np.ndarray
    micro_batches: np.ndarray
    routes: np.ndarray
    inbox_rows: int

    @classmethod
    def of(cls, table: schedules.ScheduleTable) -> BlockPlan:
        blocks = table.exchange_blocks(BLOCK_SIZE)
        if len(blocks) > (1 - MIN_BLOCK_SAVING) * table.num_ticks:
            blocks = table.exchange_blocks(1)
        p, m, ipus = table.num_stages, table.num_micro_batches, table.num_ipus
        shape = (len(blocks), len(blocks[0]), ipus)
        kinds, stage, micro = (np.zeros(shape, np.int32) for _ in range(3))
        pattern_id = np.zeros(shape[::2], np.int32)
        patterns: dict[tuple, int] = {}
        received = [[[] for _ in range(ipus)] for _ in blocks]
        for b, block in enumerate(blocks):
            ops = [table.ticks[t] if t is not None else (None,) * ipus for t in block]
            for ipu in range(ipus):
                pattern = []
                for q, tick in enumerate(ops):
                    op = tick[ipu]
                    pattern.append(_slot(op, ops[q - 1][ipu] if q else None, p))
                    if op is None:
                        continue
                    if pattern[-1][0] == "-":
                        pattern[-2] = ("FB", op.stage)
                    kinds[b, q, ipu] = FORWARD if op.phase == "F" else BACKWARD
                    stage[b, q, ipu], micro[b, q, ipu] = op.stage, op.micro_batch
                    target = op.stage + 1 if op.phase == "F" else op.stage - 1
                    if 0 <= target < p:
                        row = (0 if op.phase == "F" else p * m) + target * m + op.micro_batch
                        received[b][table.device_mapping[target]].append((ipu, q, row))
                pattern_id[b, ipu] = patterns.setdefault(tuple(pattern), len(patterns))
        spare = 2 * p * m
        width = max(len(r) for per_ipu in received for r in per_ipu)
        routes = np.array([[r + [(0, 0, spare)] * (width - len(r)) for r in per_ipu]
                           for per_ipu in received], np.int32)
        return cls(list(patterns), pattern_id, kinds, stage, micro, routes, spare + 1)

    def scanned(self) -> tuple:
        """The per-block arrays a `lax.scan` walks."""
        return tuple(jnp.asarray(a) for a in (self.kinds, self.stages, self.micro_batches,
                                               self.pattern_id, self.routes))


def _slot(op, previous, num_stages: int):
    """A pattern's entry for `op` (see `BlockPlan.patterns`)."""
    if op is None:
        return None
    fused = (op.phase == "B" and op.stage == num_stages - 1
             and previous == schedules.Op(op.stage, op.micro_batch, "F"))
    return ("-", op.stage) if fused else (op.phase, op.stage)


# --------------------------------------------------------------------------- the program


class Stages:
    """Each stage as a function of its own weights and its input, for `jax.vjp`.

    With `checkpoints`, each stage runs under `jax.checkpoint` keeping only
    its recomputation checkpoints: its pullback's residuals are those values
    (see `keras_ipu.device.checkpoints`).
    """

    def __init__(self, pipelined: PipelinedModel, state: PipelineState,
                 checkpoints: bool = False):
        self.p, self.state, self.checkpoints = pipelined, state, checkpoints
        self.runner = StageRunner(pipelined, state, distinct_replica_streams(state))
        self.own = [self.runner.own_trainable(s) for s in range(pipelined.num_stages)]
        uses = collections.Counter(i for own in self.own for i in own)
        self.shared = frozenset(i for i, count in uses.items() if count > 1)
        self.grads = GradientLayout.of(
            [list(zip(state.indices("trainable_variables", ipu), layout.shapes, layout.dtypes))
             for ipu, layout in enumerate(state.layouts["trainable_variables"])],
            state.lengths["trainable_variables"])
        self.metrics_layout = state.layouts["metrics_variables"][pipelined.last_ipu]

    def accumulated(self, s: int, acc: Any, grads: Sequence[Any], j: Any, micro: int,
                    rules: tuple[Callable, Callable]) -> Any:
        """The accumulator with stage `s`'s gradients of micro-batch `j` (in `own[s]`
        order) added in place.

        `rules` are the reduction's `ACCUMULATE` and `ACCUMULATE_SHARED` rules:
        the second for the weights other stages use too.
        """
        ipu, by_index = self.p.device_mapping[s], dict(zip(self.own[s], grads))
        for rule, shared in zip(rules, (False, True)):
            part = {i: g for i, g in by_index.items() if (i in self.shared) == shared}
            if part:
                acc = self.grads.update(
                    ipu, acc, part,
                    lambda old, grad, rule=rule: rule(old, grad, j.astype(old.dtype), micro))
        return acc

    def for_vjp(self, s: int, tv: dict, non_trainable, metrics, bundle, batch):
        """`(f, weights, known, ntv)`: stage `s` on one micro-batch, for `jax.vjp`.

        `tv` is its IPU's trainable variables by index (`StageRunner.trainable`),
        `non_trainable` the IPU's packed non-trainable flats. `known` holds what
        a backward op can give again instead of stashing: the weights, the
        input, the micro-batch (see `kept_residuals` for `ntv`).
        """
        ntv = self.runner.non_trainable(self.p.device_mapping[s], non_trainable)
        weights = [tv[i] for i in self.own[s]]
        return self.function(s, tv, ntv, metrics, batch), weights, (weights, bundle, batch), ntv

    def function(self, s: int, tv: dict, ntv: dict, metrics, batch):
        """`f(weights, bundle) -> (output, aux)`; the last stage's output is the loss.

        `aux` is `(new non-trainable dict, logs or None, new metrics flats or None)`.
        """
        model, runner, last = self.p.model, self.runner, s == self.p.num_stages - 1

        def f(weights, bundle):
            arrays = dict(tv)
            arrays.update(zip(self.own[s], weights))
            if not last:
                out, new_ntv, _, _ = runner.run_with(s, arrays, ntv, bundle, batch[0], True)
                return out, (new_ntv, None, None)
            x, y, sample_weight = batch
            _, new_ntv, y_pred, extra_loss = runner.run_with(s, arrays, ntv, bundle, x, True)
            loss, metrics_vars = stage_loss(model, self.metrics_layout.unpack(metrics), batch,
                                            y_pred, extra_loss, training=True,
                                            weights=dict(zip(self.own[s], weights)))
            # As in Keras' JAX train step, whose metrics get `y_pred` back from
            # `value_and_grad`: values without their Keras mask (the loss masks).
            y_pred = jax.tree_util.tree_map(jax.lax.stop_gradient, y_pred)
            logs, metrics_vars = model._update_metrics_variables(
                metrics_vars, loss, x, y, y_pred, sample_weight)
            metrics_flats = self.metrics_layout.pack(
                metrics_vars, self.state.lengths["metrics_variables"])
            return loss, (new_ntv, logs, metrics_flats)

        return checkpoints.recomputed_from_checkpoints(f) if self.checkpoints else f


@dataclasses.dataclass(frozen=True)
class _ShapeTrace:
    """What a trace of the program knows beyond the static set-up.

    Attributes:
        me: This IPU's index on the mesh (traced).
        bundle: The shape and type of a message between stages.
        layouts: Per stage, the layout of what its forward ops stash (the
            pullback's residuals, or, recomputing, the non-trainable values).
        lengths: Per dtype, the length of a stash row.
        logs_shape: The shapes of one micro-batch's logs.
    """

    me: Any
    bundle: jax.ShapeDtypeStruct
    layouts: list[FlatLayout]
    lengths: dict[str, int]
    logs_shape: Any

    # Zeros are made inside each branch: a value from outside would be
    # copied into the conditional's result instead of just written.
    def zero_message(self):
        return jnp.zeros(self.bundle.shape, self.bundle.dtype)

    def zero_residual(self) -> dict:
        return {d: jnp.zeros((n,), d) for d, n in self.lengths.items()}

    def zero_logs(self):
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.logs_shape)


class _Ops:
    """The forward and backward ops of one weight update's micro-batches.

    Args:
        program: The program's static set-up.
        trace: What the trace knows (`None` while it is being worked out).
        data: The update's micro-batches, `(x, y, sample_weight)`.
        weights_of: Per IPU, its trainable variables (`StageRunner.trainable`),
            sliced once per update: slicing per op would copy them per op.
        scale: The gradient of the optimizer's scaled loss by the loss
            (`loss_scale`), for the last stage's backward ops.
    """

    def __init__(self, program: _FitProgram, trace: _ShapeTrace | None, data, weights_of,
                 scale=None):
        self.program, self.trace, self.data, self.weights_of = program, trace, data, weights_of
        self.scale = scale

    def stage(self, s: int, non_trainable, metrics, bundle, j):
        """`Stages.for_vjp` of stage `s` on micro-batch `j` of the update."""
        ipu = self.program.pipelined.device_mapping[s]
        return self.program.stages.for_vjp(s, self.weights_of[ipu], non_trainable, metrics,
                                           bundle, micro_batch_at(self.data, j))

    def stash_shapes(self, s: int, non_trainable, metrics, bundle, j):
        """What a forward op of stage `s` stashes (for `jax.eval_shape`)."""
        f, weights, known, ntv = self.stage(s, non_trainable, metrics, bundle, j)
        _, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
        return kept_residuals(vjp_fn, aux, known, ntv)[0]

    def forward(self, s: int, non_trainable, metrics, bundle, j):
        """`(non_trainable, metrics, logs, message, residual)` of a forward op."""
        program, trace = self.program, self.trace
        f, weights, known, ntv = self.stage(s, non_trainable, metrics, bundle, j)
        if program.recompute:
            out, aux = f(weights, bundle)
            # The non-trainable values as this op found them: later forward ops move them
            # (a dropout's seed), and the recomputation must draw as this op did.
            residual = trace.layouts[s].pack(jax.tree_util.tree_leaves(ntv), trace.lengths)
        else:
            out, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
            kept = kept_residuals(vjp_fn, aux, known, ntv)[0]
            residual = trace.layouts[s].pack(kept, trace.lengths)
        new_ntv, step_logs, new_metrics = aux
        non_trainable = program.stages.runner.pack_non_trainable(
            program.pipelined.device_mapping[s], new_ntv)
        if s == program.last:
            return non_trainable, new_metrics, step_logs, trace.zero_message(), residual
        return non_trainable, metrics, trace.zero_logs(), out, residual

    def backward(self, s: int, non_trainable, metrics, bundle, gradient, residual, j,
                 fused: bool):
        """`(non_trainable, metrics, logs, message, weight grads)` of a backward op.

        `fused`: the last stage's forward op runs in it too (no stash).
        """
        program, trace = self.program, self.trace
        f, weights, known, ntv = self.stage(s, non_trainable, metrics, bundle, j)
        if program.recompute and not fused:  # from the forward op's non-trainable values
            then = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ntv),
                                                trace.layouts[s].unpack(residual))
            ipu = program.pipelined.device_mapping[s]
            f = program.stages.function(s, self.weights_of[ipu], then, metrics,
                                        micro_batch_at(self.data, j))
        # Unfused, the pullback is traced for its structure only: XLA drops
        # the forward computation when the residuals come from the stash.
        out, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
        step_logs = trace.zero_logs()
        if fused:
            new_ntv, step_logs, metrics = aux
            non_trainable = program.stages.runner.pack_non_trainable(
                program.pipelined.device_mapping[s], new_ntv)
        elif not program.recompute:
            _, treedef, source, known = kept_residuals(vjp_fn, aux, known, ntv)
            vjp_fn = join_residuals(treedef, source, trace.layouts[s].unpack(residual), known)
        cotangent = loss_cotangent(out, self.scale) if s == program.last else gradient
        grads, g_in = vjp_fn(cotangent)
        return non_trainable, metrics, step_logs, g_in, grads


class _FitProgram:
    """The training execution; see `build_fit_program`."""

    def __init__(self, pipelined: PipelinedModel, state: PipelineState,
                 table: schedules.ScheduleTable, reduction: Reduction,
                 accumulators: Mapping[str, str], recompute: bool, checkpoints: bool = False):
        self.pipelined, self.state, self.recompute = pipelined, state, recompute
        self.stages = Stages(pipelined, state, checkpoints)
        self.micro, self.last = table.num_micro_batches, pipelined.num_stages - 1
        self.plan = BlockPlan.of(table)
        self.gradient_rows = pipelined.num_stages * self.micro  # the inbox's gradient rows
        self.accumulate, self.accumulators = ACCUMULATE[reduction], dict(accumulators)
        self.rules = (self.accumulate, ACCUMULATE_SHARED[reduction])
        # A running mean rescales what it has summed at each micro-batch, so
        # each backward op updates its own parts of the accumulator (which
        # costs a copy of it per block). The linear reductions add the
        # block's summed gradients outside the conditional instead.
        self.in_place = reduction == Reduction.RUNNING_MEAN
        row_offset, self.slots, self.rows = _stash_rows(table)
        self.row_offset = jnp.asarray(row_offset)
        # Per block, an IPU stashes at most this many forward ops' residuals.
        self.stash_rows_out = max(
            sum(entry is not None and entry[0] == "F" for entry in pattern)
            for pattern in self.plan.patterns) or 1

    def __call__(self, packed, batches):
        local = jax.tree_util.tree_map(lambda a: a[0, 0], packed)
        batches = jax.tree_util.tree_map(lambda a: a[:, 0], batches)
        trace = self._trace(local, batches)
        inbox = jnp.zeros((self.plan.inbox_rows, *trace.bundle.shape), trace.bundle.dtype)
        stash = {d: jnp.zeros((self.rows, n), d) for d, n in trace.lengths.items()}
        carry = tuple(local[part] for part in TRAINING_STATE_PARTS) + (stash, inbox)
        carry, logs = jax.lax.scan(functools.partial(self._update, trace), carry, batches)
        new = {part: jax.tree_util.tree_map(lambda a: a[None, None], value)
               for part, value in zip(TRAINING_STATE_PARTS, carry)}
        return new, jax.tree_util.tree_map(lambda a: a[:, None], logs)

    def _trace(self, local, batches) -> _ShapeTrace:
        """Shapes and stash layouts, from tracing each stage once (nothing runs)."""
        first = micro_batch_at(batches, 0)
        spec = self.pipelined.bundle(micro_batch_at(first, 0)[0])
        bundle = jnp.zeros(spec.shape, spec.dtype)
        ops = _Ops(self, None, first, self._weights(local["trainable_variables"]))
        args = (local["non_trainable_variables"], local["metrics_variables"], bundle, 0)
        # Recomputing, a forward op stashes the stage's non-trainable values, else the
        # residuals of its pullback.
        stashed = ((lambda s: jax.tree_util.tree_leaves(ops.stage(s, *args)[3]))
                   if self.recompute else (lambda s: ops.stash_shapes(s, *args)))
        layouts = [FlatLayout.of(jax.eval_shape(lambda s=s: stashed(s)))
                   for s in range(self.pipelined.num_stages)]

        def last_stage_logs():
            f, weights, _, _ = ops.stage(self.last, *args)
            return f(weights, bundle)[1][1]

        return _ShapeTrace(self.state.mesh.axis_index(IPU_AXIS), spec, layouts,
                      padded_lengths(layouts) if layouts else {},
                      jax.eval_shape(last_stage_logs))

    def _weights(self, trainable) -> list[dict]:
        runner = self.stages.runner
        return [runner.trainable(d, trainable) for d in range(self.pipelined.num_ipus)]

    def _update(self, trace: _ShapeTrace, carry, data):
        """One weight update: the table's blocks, then each IPU's optimizer."""
        # The inbox needs no clearing between updates: every row an op reads
        # was written earlier in the same update, but stage 0's rows, which
        # nothing writes (they stay zero: no additional loss comes before
        # stage 0).
        trainable, non_trainable, optimizer_vars, metrics, stash, inbox = carry
        p, me = self.pipelined, trace.me
        # Read on every IPU, used by the last stage's (whose IPU's clone it reads).
        scale = loss_scale(p, self.state, optimizer_vars)
        ops = _Ops(self, trace, data, self._weights(trainable), scale)
        branches = [self._branch(ops, pattern) for pattern in self.plan.patterns]
        logs = jax.tree_util.tree_map(lambda a: jnp.zeros((self.micro, *a.shape), a.dtype),
                                      trace.logs_shape)
        c = (non_trainable, metrics, self.stages.grads.zeros(self.accumulators), inbox,
             logs, stash)
        c, _ = jax.lax.scan(functools.partial(self._block, trace, branches), c,
                            self.plan.scanned())
        non_trainable, metrics, acc, inbox, logs, stash = c
        if self.state.replicas > 1:
            acc = self.state.mesh.psum(acc, REPLICA_AXIS)
        finite = None
        if p.loss_scaled:
            finite = self.state.mesh.psum((~all_finite(acc)).astype(jnp.int32), IPU_AXIS) == 0
            acc = skipped_unless(finite, acc)
        squared = None
        if p.global_clipnorm:  # the norm over every IPU's gradients
            squared = self.state.mesh.psum(squared_norm(acc), IPU_AXIS)
        trainable, optimizer_vars = self.state.mesh.switch(
            IPU_AXIS, me, [optimizer_update(p, self.state, self.stages.grads, d)
                 for d in range(p.num_ipus)],
            trainable, optimizer_vars, acc, squared, finite)
        # Only the last stage's IPU has the logs; the others hold zeros.
        logs = self.state.mesh.psum(
            jax.tree_util.tree_map(lambda a: jnp.where(me == p.last_ipu, a, 0), logs),
            IPU_AXIS)
        return (trainable, non_trainable, optimizer_vars, metrics, stash, inbox), logs

    def _branch(self, ops: _Ops, pattern):
        """One IPU's ops of a block, back to back, as one branch of the switch.

        The branch reads what its ops need from the inbox and the stash
        itself: only it knows which slots are forward or backward ops.
        """
        trace, grads_layout, micro = ops.trace, self.stages.grads, self.micro

        def branch(non_trainable, metrics, acc, inbox, stash, js):
            size = len(pattern)
            logs_q, messages = [None] * size, [None] * size
            stashed, targets, summed = [], [], []
            for q, entry in enumerate(pattern):
                if entry is None or entry[0] == "-":
                    continue
                phase, s = entry
                j = js[q]
                bundle = inbox[s * micro + j]
                row = self.row_offset[s] + j % self.slots
                if phase == "F":
                    non_trainable, metrics, logs_q[q], messages[q], residual = ops.forward(
                        s, non_trainable, metrics, bundle, j)
                    stashed.append(residual)
                    targets.append(row)
                    continue
                non_trainable, metrics, logs_q[q], message, grads = ops.backward(
                    s, non_trainable, metrics, bundle,
                    inbox[self.gradient_rows + s * micro + j],
                    {d: buf[row] for d, buf in stash.items()}, j, phase == "FB")
                # A fused op's message belongs to its backward slot.
                messages[q + (phase == "FB")] = message
                if self.in_place:
                    acc = self.stages.accumulated(s, acc, grads, j, self.micro, self.rules)
                else:
                    summed.append(grads_layout.pack(self.pipelined.device_mapping[s],
                                                    dict(zip(self.stages.own[s], grads)),
                                                    self.accumulators))
            if not self.in_place:
                # The sum of the block's gradients (or zeros); the accumulator
                # is updated outside the conditional.
                acc = (jax.tree_util.tree_map(lambda *g: sum(g[1:], g[0]), *summed)
                       if summed else grads_layout.zeros(self.accumulators))
            # Rows to stash, and where: the spare row for unused ones.
            spare = self.stash_rows_out - len(stashed)
            stashed += [trace.zero_residual() for _ in range(spare)]
            targets = jnp.stack(targets + [jnp.int32(self.rows - 1)] * spare)
            return (non_trainable, metrics, acc,
                    jax.tree_util.tree_map(lambda *v: jnp.stack(v),
                                           *_filled(logs_q, trace.zero_logs)),
                    jnp.stack(_filled(messages, trace.zero_message)),
                    ({d: jnp.stack([r[d] for r in stashed]) for d in trace.lengths}, targets))

        return branch

    def _block(self, trace: _ShapeTrace, branches, c, rows_of_block):
        """One block: this IPU's branch, then stash, logs and the exchange."""
        non_trainable, metrics, acc, inbox, logs, stash = c
        kinds, stage, micro_b, pattern_id, routes = rows_of_block
        me = trace.me
        mine = [(kinds[q, me], stage[q, me], micro_b[q, me]) for q in range(kinds.shape[0])]
        non_trainable, metrics, result, step_logs, messages, (stashed, targets) = \
            self.state.mesh.switch(IPU_AXIS, pattern_id[me], branches, non_trainable, metrics,
                                   acc, inbox, stash, jnp.stack([j for _, _, j in mine]))
        acc = result if self.in_place else jax.tree_util.tree_map(
            lambda a, r: self.accumulate(a, r, None, self.micro), acc, result)
        for r in range(self.stash_rows_out):
            stash = {d: buf.at[targets[r]].set(stashed[d][r]) for d, buf in stash.items()}
        for q, (kind, s, j) in enumerate(mine):
            logs = jax.tree_util.tree_map(
                lambda b, v, kind=kind, s=s, j=j, q=q: b.at[j].set(
                    jnp.where((kind == FORWARD) & (s == self.last), v[q], b[j])),
                logs, step_logs)
        gathered = self.state.mesh.all_gather(messages, IPU_AXIS)
        for sender, q, row in routes[me]:
            inbox = inbox.at[row].set(gathered[sender, q])
        return (non_trainable, metrics, acc, inbox, logs, stash), None


def build_fit_program(pipelined: PipelinedModel, state: PipelineState,
                      table: schedules.ScheduleTable, reduction: Reduction,
                      accumulators: Mapping[str, str], recompute: bool = False,
                      checkpoints: bool = False):
    """The training execution: `(packed state, batches) -> (packed state, logs)`.

    Args:
        pipelined: The model's stages and their IPUs.
        state: The packed state layout (set up by `state.to_device`).
        table: The training schedule table of one weight update.
        reduction: How micro-batch gradients combine.
        accumulators: Per variable dtype, the dtype its gradients accumulate
            in (an IPU accumulates each dtype's variables in one vector).
        recompute: Recompute stage activations in backward ops instead of
            stashing them.
        checkpoints: Stash only each stage's recomputation checkpoints and
            recompute the rest from them (with `recompute` False).

    Returns:
        A function to `jax.jit`: `batches` is `(x, y, sample_weight)` (absent
        parts `None`), each leaf `[updates, replicas, micro_batches, batch,
        ...]`; logs come back per micro-batch, `[updates, replicas,
        micro_batches]`.
    """
    return state.mesh.map(
        _FitProgram(pipelined, state, table, reduction, accumulators, recompute,
                    checkpoints),
        in_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
        out_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
    )


def _filled(values: list, zero) -> list:
    """`values` with each `None` replaced by `zero()`."""
    return [value if value is not None else zero() for value in values]


def loss_cotangent(loss, scale):
    """The cotangent of the last stage's loss.

    Args:
        loss: The last stage's loss (a float32 scalar).
        scale: The loss scale (`loss_scale`), or `None` for none.

    Returns:
        `scale` (or 1) in the loss's shape and dtype: pulling it back gives
        the gradients of the scaled loss, as Keras differentiates it.

    Example:

    >>> grads, g_in = vjp_fn(loss_cotangent(loss, scale))
    """
    if scale is None:
        return jnp.ones_like(loss)
    return jnp.broadcast_to(scale, jnp.shape(loss)).astype(loss.dtype)


__all__ = ["Stages", "build_fit_program", "join_residuals", "kept_residuals",
           "loss_cotangent", "split_residuals"]
