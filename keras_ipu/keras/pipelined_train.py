"""The pipelined training execution: the schedule table run block by block.

One execution is one compiled program (`jax.jit` of a `shard_map` over the
IPUs of a replica, and over the replicas). Per weight update it walks the
schedule table in blocks of ticks (`ScheduleTable.exchange_blocks`): in a
block every IPU runs its ops back to back, each op chosen by `lax.switch`
(forward or backward of one stage on one micro-batch, or nothing); after the
block all IPUs exchange the block's messages (activations forward,
activation gradients backward) in one `all_gather`.

A forward op keeps what its backward op needs in a stash: the residuals of
`jax.vjp` of the stage (its activations), without the values the backward op
can take again itself (weights, its input, the micro-batch). With
recomputation (`IPUConfig.allow_recompute` or a `recomputation_mode`) it
keeps nothing but its input, and the backward op recomputes the stage
forward. Stash rows are reused as soon as a micro-batch's backward op has
run: a stage holds at most its `stash_counts()` micro-batches.

One `lax.switch` per block picks what an IPU does in it (its ops of the
block as one branch: the table's distinct per-IPU patterns). The last
stage's forward op and its backward op on the same micro-batch run fused
when they share a block. A backward op adds its stage's weight gradients
into its slices of the IPU's flat accumulator, in place. After an update's
micro-batches, gradients are summed over replicas and each IPU applies its
own optimizer clone to its variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from keras_ipu.device import pipeline as schedules
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod as Reduction
from keras_ipu.keras.pipeline_gradients import GradientLayout
from keras_ipu.keras.pipelined import (
    _BACKWARD,
    _FORWARD,
    IPU_AXIS,
    REPLICA_AXIS,
    TRAINING_STATE_PARTS,
    FlatLayout,
    PipelinedModel,
    PipelineState,
    StageRunner,
    _index,
    _padded_lengths,
    stage_loss,
)
from keras_ipu.keras.steps import ACCUMULATE

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
                    kinds[b, q, ipu] = _FORWARD if op.phase == "F" else _BACKWARD
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


class _Stages:
    """Each stage as a function of its own weights and its input, for `jax.vjp`."""

    def __init__(self, pipelined: PipelinedModel, state: PipelineState):
        self.p, self.state = pipelined, state
        self.runner = StageRunner(pipelined, state)
        self.own = [self.runner.own_trainable(s) for s in range(pipelined.num_stages)]
        self.grads = GradientLayout.of(
            [list(zip(state._indices("trainable_variables", ipu), layout.shapes, layout.dtypes))
             for ipu, layout in enumerate(state.layouts["trainable_variables"])],
            state.lengths["trainable_variables"])
        self.metrics_layout = state.layouts["metrics_variables"][pipelined.last_ipu]

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
                                            y_pred, extra_loss, training=True)
            logs, metrics_vars = model._update_metrics_variables(
                metrics_vars, loss, x, y, y_pred, sample_weight)
            metrics_flats = self.metrics_layout.pack(
                metrics_vars, self.state.lengths["metrics_variables"])
            return loss, (new_ntv, logs, metrics_flats)

        return f


def build_fit_program(pipelined: PipelinedModel, state: PipelineState,
                      table: schedules.ScheduleTable, reduction: Reduction,
                      accumulator_dtype: str = "float32", recompute: bool = False):
    """The training execution: `(packed state, batches) -> (packed state, logs)`.

    Args:
        pipelined: The model's stages and their IPUs.
        state: The packed state layout (set up by `state.to_device`).
        table: The training schedule table of one weight update.
        reduction: How micro-batch gradients combine.
        accumulator_dtype: The dtype gradients accumulate in.
        recompute: Recompute stage activations in backward ops instead of
            stashing them.

    Returns:
        A function to `jax.jit`: `batches` is `(x, y, sample_weight)` (absent
        parts `None`), each leaf `[updates, replicas, micro_batches, batch,
        ...]`; logs come back per micro-batch, `[updates, replicas,
        micro_batches]`.
    """
    p = pipelined
    stages = _Stages(pipelined, state)
    runner, num_stages, micro = stages.runner, p.num_stages, table.num_micro_batches
    plan = BlockPlan.of(table)
    gradient_rows = num_stages * micro  # inbox rows of gradients start here
    accumulate = ACCUMULATE[reduction]
    # A running mean rescales what it has summed at each micro-batch, so each
    # backward op updates its own slices of the accumulator (which costs a copy
    # of it per block). The linear reductions add the block's summed
    # gradients outside the conditional instead, which is cheaper.
    in_place = reduction == Reduction.RUNNING_MEAN
    row_offset, slots, rows = _stash_rows(table)
    # Per block, an IPU stashes at most this many forward ops' residuals.
    stash_rows_out = max(sum(entry is not None and entry[0] == "F" for entry in pattern)
                         for pattern in plan.patterns) or 1
    row_offset = jnp.asarray(row_offset)
    last = num_stages - 1

    def per_replica(packed, batches):
        local = jax.tree_util.tree_map(lambda a: a[0, 0], packed)
        batches = jax.tree_util.tree_map(lambda a: a[:, 0], batches)
        me = jax.lax.axis_index(IPU_AXIS)
        first = _index(batches, 0)
        mb = jax.tree_util.tree_leaves(first[0])[0].shape[1]
        bundle_shape = p.bundle_shape(mb)
        trainable0, non_trainable0 = local["trainable_variables"], local["non_trainable_variables"]

        def op_inputs(s, weights_of, non_trainable, bundle, batch):
            """`weights_of`: per IPU, its trainable variables (`runner.trainable`)."""
            ipu = p.device_mapping[s]
            tv = weights_of[ipu]
            ntv = runner.non_trainable(ipu, non_trainable)
            weights = [tv[i] for i in stages.own[s]]
            return tv, ntv, weights, (weights, bundle, batch)

        def unpacked(trainable):
            # Sliced out once per update for every IPU's layout (each IPU
            # uses its own): slicing per op would copy the weights per op.
            return [runner.trainable(d, trainable) for d in range(p.num_ipus)]

        weights0 = unpacked(trainable0)

        def residuals_of(s):
            """The stash layout of stage `s` (traced once, for shapes only)."""
            def kept():
                bundle = jnp.zeros(bundle_shape, jnp.float32)
                batch = _index(first, 0)
                tv, ntv, weights, known = op_inputs(s, weights0, non_trainable0, bundle, batch)
                f = stages.function(s, tv, ntv, local["metrics_variables"], batch)
                _, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
                unchanged = [v for i, v in ntv.items() if aux[0][i] is v]
                return split_residuals(vjp_fn, (known, unchanged))[0]
            return FlatLayout.of(jax.eval_shape(kept))

        layouts = [] if recompute else [residuals_of(s) for s in range(num_stages)]
        lengths = _padded_lengths(layouts) if layouts else {}
        stash0 = {d: jnp.zeros((rows, n), d) for d, n in lengths.items()}
        # Zeros are made inside each branch: a value from outside would be
        # copied into the conditional's result instead of just written.
        def zero_message():
            return jnp.zeros(bundle_shape, jnp.float32)

        def zero_residual():
            return {d: jnp.zeros((n,), d) for d, n in lengths.items()}

        def last_stage_logs():
            batch = _index(first, 0)
            tv, ntv, weights, _ = op_inputs(last, weights0, non_trainable0, zero_message(),
                                            batch)
            f = stages.function(last, tv, ntv, local["metrics_variables"], batch)
            return f(weights, zero_message())[1][1]

        logs_shape = jax.eval_shape(last_stage_logs)

        def zero_logs():
            return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), logs_shape)

        def update(carry, data):
            # The inbox needs no clearing between updates: every row an op
            # reads was written earlier in the same update, but stage 0's
            # rows, which nothing writes (they stay zero: no additional loss
            # comes before stage 0).
            trainable, non_trainable, optimizer_vars, metrics, stash, inbox = carry
            acc = stages.grads.zeros(accumulator_dtype)
            weights_of = unpacked(trainable)
            logs = jax.tree_util.tree_map(lambda a: jnp.zeros((micro, *a.shape), a.dtype),
                                          logs_shape)

            def forward(s, non_trainable, metrics, bundle, j):
                """`(non_trainable, metrics, logs, message, residual)`."""
                batch = _index(data, j)
                tv, ntv, weights, known = op_inputs(s, weights_of, non_trainable, bundle, batch)
                f = stages.function(s, tv, ntv, metrics, batch)
                if recompute:
                    out, aux = f(weights, bundle)
                    residual = zero_residual()
                else:
                    out, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
                    unchanged = [v for i, v in ntv.items() if aux[0][i] is v]
                    residual = layouts[s].pack(split_residuals(vjp_fn, (known, unchanged))[0],
                                               lengths)
                new_ntv, step_logs, new_metrics = aux
                non_trainable = runner.pack_non_trainable(p.device_mapping[s], new_ntv)
                if s == last:
                    return non_trainable, new_metrics, step_logs, zero_message(), residual
                return non_trainable, metrics, zero_logs(), out, residual

            def backward(s, non_trainable, metrics, bundle, gradient, residual, j, fused):
                """`(non_trainable, metrics, logs, message, grads)`; `fused`: with the forward."""
                batch = _index(data, j)
                tv, ntv, weights, known = op_inputs(s, weights_of, non_trainable, bundle, batch)
                f = stages.function(s, tv, ntv, metrics, batch)
                # Unfused, the pullback is traced for its structure only: XLA
                # drops the forward computation when the residuals come from
                # the stash.
                out, vjp_fn, aux = jax.vjp(f, weights, bundle, has_aux=True)
                step_logs = zero_logs()
                if fused:
                    new_ntv, step_logs, metrics = aux
                    non_trainable = runner.pack_non_trainable(p.device_mapping[s], new_ntv)
                elif not recompute:
                    unchanged = [v for i, v in ntv.items() if aux[0][i] is v]
                    _, treedef, source = split_residuals(vjp_fn, (known, unchanged))
                    vjp_fn = join_residuals(treedef, source, layouts[s].unpack(residual),
                                            (known, unchanged))
                cotangent = jnp.ones_like(out) if s == last else gradient
                grads, g_in = vjp_fn(cotangent)
                return non_trainable, metrics, step_logs, g_in, grads

            def rule_for(j):
                """The reduction's update of an accumulator part by micro-batch `j`."""
                n = j.astype(accumulator_dtype)
                return lambda old, grad: accumulate(old, grad, n, micro)

            def run_pattern(pattern):
                """One IPU's ops of a block, back to back, as one branch.

                The branch reads what its ops need from the inbox and the
                stash itself: only it knows which slots are forward or
                backward ops.
                """
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
                        row = row_offset[s] + j % slots
                        if phase == "F":
                            non_trainable, metrics, logs_q[q], messages[q], residual = forward(
                                s, non_trainable, metrics, bundle, j)
                            stashed.append(residual)
                            targets.append(row)
                            continue
                        gradient = inbox[gradient_rows + s * micro + j]
                        residual = {d: buf[row] for d, buf in stash.items()}
                        non_trainable, metrics, logs_q[q], message, grads = backward(
                            s, non_trainable, metrics, bundle, gradient, residual, j,
                            phase == "FB")
                        # A fused op's message belongs to its backward slot.
                        messages[q + (phase == "FB")] = message
                        ipu, by_index = p.device_mapping[s], dict(zip(stages.own[s], grads))
                        if in_place:
                            acc = stages.grads.update(ipu, acc, by_index, rule_for(j))
                        else:
                            summed.append(stages.grads.pack(ipu, by_index, accumulator_dtype))
                    logs_out = jax.tree_util.tree_map(lambda *v: jnp.stack(v),
                                                      *_filled(logs_q, zero_logs))
                    # Rows to stash, and where: the spare row for unused ones.
                    spare = stash_rows_out - len(stashed)
                    stashed += [zero_residual() for _ in range(spare)]
                    targets = jnp.stack(targets + [jnp.int32(rows - 1)] * spare)
                    stash_out = ({d: jnp.stack([r[d] for r in stashed]) for d in lengths},
                                 targets)
                    if not in_place:
                        # The sum of the block's gradients (or zeros); the
                        # accumulator is updated outside the conditional.
                        acc = (jax.tree_util.tree_map(lambda *g: sum(g[1:], g[0]), *summed)
                               if summed else stages.grads.zeros(accumulator_dtype))
                    return (non_trainable, metrics, acc, logs_out,
                            jnp.stack(_filled(messages, zero_message)), stash_out)
                return branch

            branches = [run_pattern(pattern) for pattern in plan.patterns]

            def block(c, rows_of_block):
                non_trainable, metrics, acc, inbox, logs, stash = c
                kinds, stage, micro_b, pattern_id, routes = rows_of_block
                mine = [(kinds[q, me], stage[q, me], micro_b[q, me])
                        for q in range(kinds.shape[0])]
                non_trainable, metrics, result, step_logs, messages, stashed = jax.lax.switch(
                    pattern_id[me], branches, non_trainable, metrics, acc, inbox, stash,
                    jnp.stack([j for _, _, j in mine]))
                acc = result if in_place else jax.tree_util.tree_map(
                    lambda a, r: accumulate(a, r, None, micro), acc, result)
                stashed, targets = stashed
                for r in range(stash_rows_out):
                    stash = {d: buf.at[targets[r]].set(stashed[d][r]) for d, buf in stash.items()}
                for q, (kind, s, j) in enumerate(mine):
                    logs = jax.tree_util.tree_map(
                        lambda b, v, kind=kind, s=s, j=j, q=q: b.at[j].set(
                            jnp.where((kind == _FORWARD) & (s == last), v[q], b[j])),
                        logs, step_logs)
                gathered = jax.lax.all_gather(messages, IPU_AXIS)
                for sender, q, row in routes[me]:
                    inbox = inbox.at[row].set(gathered[sender, q])
                return (non_trainable, metrics, acc, inbox, logs, stash), None

            c = (non_trainable, metrics, acc, inbox, logs, stash)
            c, _ = jax.lax.scan(block, c, plan.scanned())
            non_trainable, metrics, acc, inbox, logs, stash = c
            if state.replicas > 1:
                acc = jax.lax.psum(acc, REPLICA_AXIS)
            trainable, optimizer_vars = jax.lax.switch(
                me, [_apply_optimizer(pipelined, state, stages.grads, d)
                     for d in range(p.num_ipus)],
                trainable, optimizer_vars, acc)
            # Only the last stage's IPU has the logs; the others hold zeros.
            logs = jax.lax.psum(
                jax.tree_util.tree_map(lambda a: jnp.where(me == p.last_ipu, a, 0), logs),
                IPU_AXIS)
            return (trainable, non_trainable, optimizer_vars, metrics, stash, inbox), logs

        inbox0 = jnp.zeros((plan.inbox_rows, *bundle_shape), jnp.float32)
        carry = tuple(local[part] for part in TRAINING_STATE_PARTS) + (stash0, inbox0)
        carry, logs = jax.lax.scan(update, carry, batches)
        new = {part: jax.tree_util.tree_map(lambda a: a[None, None], value)
               for part, value in zip(TRAINING_STATE_PARTS, carry)}
        return new, jax.tree_util.tree_map(lambda a: a[:, None], logs)

    return jax.shard_map(
        per_replica,
        mesh=state.mesh,
        in_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
        out_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
        check_vma=False,
    )


def _filled(values: list, zero) -> list:
    """`values` with each `None` replaced by `zero()`."""
    return [value if value is not None else zero() for value in values]


def _apply_optimizer(pipelined: PipelinedModel, state: PipelineState,
                     grads_layout: GradientLayout, ipu: int):
    t_layout = state.layouts["trainable_variables"][ipu]
    o_layout = state.layouts["optimizer_variables"][ipu]
    optimizer = pipelined.optimizers[ipu]

    def apply(trainable, optimizer_vars, acc):
        variables = t_layout.unpack(trainable)
        grads = [g.astype(v.dtype) for g, v in zip(grads_layout.unpack(ipu, acc), variables)]
        variables, optimizer_values = optimizer.stateless_apply(
            o_layout.unpack(optimizer_vars), grads, variables)
        return (t_layout.pack(variables, state.lengths["trainable_variables"]),
                o_layout.pack(optimizer_values, state.lengths["optimizer_variables"]))

    return apply


__all__ = ["build_fit_program", "join_residuals", "split_residuals"]
