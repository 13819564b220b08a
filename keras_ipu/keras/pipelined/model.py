"""Pipelined execution: a model's stages on their IPUs, following a schedule table.

One execution is one compiled program (`jax.jit` of a `shard_map` over the IPUs of a
replica, and over the replicas). Each IPU holds only the weights, non-trainable state and
optimizer state of its stages, packed into flat per-dtype vectors (padded to the largest
IPU). This module holds the set-up (which stage and variable lives where), the packed
state, the stage runner and the inference program, which walks the schedule table tick by
tick (`lax.scan`): at each tick every IPU runs the forward op the table gives it, then all
IPUs exchange the tick's activations. Training is in `pipelined.training`; the mesh, codec
and data layout in `pipelined.codec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec as P
from keras.src import tree

from keras_ipu.device import schedules
from keras_ipu.device import system as ipu_system
from keras_ipu.device.mesh import IPUMesh
from keras_ipu.keras import stages, steps
from keras_ipu.keras.pipelined import (
    boundary,
    instances,
    optimizer_copies,
    placement,
    samples,
)
from keras_ipu.keras.pipelined.flat_optimizer import FlatOptimizer
from keras_ipu.keras.pipelined.loss import stage_loss
from keras_ipu.keras.steps import STATE_PARTS, replica_seed_mask, xor_seed_words

IPU_AXIS = "ipu"
REPLICA_AXIS = "replica"
IDLE, FORWARD, BACKWARD = 0, 1, 2


# --------------------------------------------------------------------------- packing


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each of a list of arrays lives in flat per-dtype vectors.

    Args:
        shapes: The arrays' shapes.
        dtypes: The arrays' dtypes (names).
        sizes: Per dtype, the flat vector's length (may be padded later).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: dict[str, int]

    @classmethod
    def of(cls, arrays: Sequence[Any]) -> FlatLayout:
        shapes, dtypes, offsets, sizes = [], [], [], {}
        for array in arrays:
            dtype = str(np.dtype(array.dtype))
            shapes.append(tuple(array.shape))
            dtypes.append(dtype)
            offsets.append(sizes.get(dtype, 0))
            sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(array.shape))
        return cls(tuple(shapes), tuple(dtypes), tuple(offsets), sizes)

    def unpack(self, flats: dict[str, Any]) -> list[Any]:
        """The arrays from flat vectors (works on NumPy and traced arrays)."""
        return [
            flats[dtype][offset : offset + int(np.prod(shape))].reshape(shape)
            for shape, dtype, offset in zip(self.shapes, self.dtypes, self.offsets)
        ]

    def pack(self, arrays: Sequence[Any], lengths: dict[str, int], xp=jnp) -> dict[str, Any]:
        """Flat vectors (padded to `lengths`) holding the arrays."""
        flats = {}
        for dtype, length in lengths.items():
            parts = [
                xp.ravel(a) for a, d in zip(arrays, self.dtypes) if d == dtype
            ]
            used = sum(int(np.prod(s)) for s, d in zip(self.shapes, self.dtypes) if d == dtype)
            parts.append(xp.zeros((length - used,), dtype))
            flats[dtype] = xp.concatenate(parts)
        return flats


def padded_lengths(layouts: Sequence[FlatLayout]) -> dict[str, int]:
    lengths: dict[str, int] = {}
    for layout in layouts:
        for dtype, size in layout.sizes.items():
            lengths[dtype] = max(lengths.get(dtype, 0), size)
    return lengths


# --------------------------------------------------------------------------- the plan


class PipelinedModel:
    """A Keras model split into stages and placed on IPUs (set-up, host side).

    Args:
        model: The Keras model (compiled when it trains).
        plan: The model's `PipelinePlan` (its layer calls per stage, tensors
            named by keys, the bundle each stage forwards).
        device_mapping: Per stage, the IPU (within a replica) it runs on.
        training: Whether it trains (its shapes are traced so): only then does
            each IPU get a copy of the optimizer (inference needs none, also
            where the trainable weights changed since it was built).

    Raises:
        ValueError: When a layer, or a trainable variable, is used by stages
            on different IPUs (`placement.layers_per_ipu`).
    """

    def __init__(self, model, plan, device_mapping: Sequence[int], training: bool = True):
        self.model, self.plan = model, plan
        self.num_stages = plan.num_stages
        self.device_mapping = tuple(device_mapping)
        self.num_ipus = max(self.device_mapping) + 1
        self.bundle_in = [plan.live_after[s - 1] if s else () for s in range(self.num_stages)]
        self.bundle_out = [plan.live_after[s] if s < self.num_stages - 1 else ()
                           for s in range(self.num_stages)]
        self._traced_samples: dict[tuple, samples.TracedSamples] = {}  # per input shape
        self.training = training
        self._place_variables(training)

    def samples(self, x) -> Mapping[Any, boundary.Sample]:
        """Per tensor key, its per-sample shapes (`boundary.Sample`) for inputs like `x`.

        Args:
            x: One micro-batch of the model inputs (arrays, tracers or shape
                structs), the batch first.

        Returns:
            The shapes and types the layers give `x` (once per input shape).
        """
        return self._traced(x).samples

    def adds_losses(self, x) -> bool:
        """Whether the stages add losses for inputs like `x` (`add_loss`, ...), in its mode."""
        return self._traced(x).adds_losses or any(
            getattr(v, "regularizer", None) is not None for v in self.model.trainable_variables)

    def _traced(self, x) -> samples.TracedSamples:
        signature = tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in tree.flatten(x))
        if signature not in self._traced_samples:
            variables = self.model.trainable_variables + self.model.non_trainable_variables
            self._traced_samples[signature] = samples.samples_for(self.plan, variables, x,
                                                                  self.training)
        return self._traced_samples[signature]

    def bundle(self, x) -> jax.ShapeDtypeStruct:
        """What a stage sends the next: `[batch + 1, width]` of `boundary.bundle_dtype`.

        Row `i < batch` is sample `i`'s tensors, flattened and padded to the
        widest boundary's; the last row carries the additional losses
        (regularizers, `add_loss`) of the stages so far to the last stage's
        loss (`boundary.carry_loss`). A row, not a column: the samples stay
        one contiguous block.

        Args:
            x: One micro-batch of the model inputs (arrays, tracers or shape
                structs), the batch first.

        Returns:
            The bundle's shape and type.
        """
        found = self.samples(x)
        dtype = boundary.bundle_dtype([found[k].dtype or self.plan.tensors[k].dtype
                                       for keys in self.bundle_out[:-1] for k in keys])
        width = max([sum(found[k].width for k in keys) for keys in self.plan.live_after[:-1]]
                    + [boundary.LOSS_WIDTH[dtype]])
        return jax.ShapeDtypeStruct((tree.flatten(x)[0].shape[0] + 1, width), dtype)

    def _place_variables(self, training: bool) -> None:
        model = self.model
        layers_of = placement.layers_per_ipu(self.plan, self.device_mapping)
        index = {id(v): i for i, v in enumerate(model.trainable_variables)}
        nt_index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}

        def variables(layer, kind):
            return getattr(layer, kind, [])

        self.trainable_of = [
            _unique([index[id(v)] for layer in layers
                     for v in variables(layer, "trainable_variables")])
            for layers in layers_of
        ]
        self.non_trainable_of = [
            _unique([nt_index[id(v)] for layer in layers
                     for v in variables(layer, "non_trainable_variables")])
            for layers in layers_of
        ]
        _check_placed(model, self.trainable_of, self.non_trainable_of)
        self.last_ipu = self.device_mapping[-1]
        self.optimizers, self.optimizer_of = [], []
        # Per IPU: the flat form of its clone (`None` where it has none),
        # and the order the packed state holds the clone's variables in.
        self.flat_optimizers, self.optimizer_storage = [], []
        self.global_clipnorm: float | None = None
        optimizer = getattr(model, "optimizer", None)
        if not training or optimizer is None or not optimizer.built:
            return  # inference needs no optimizer
        _check_built_for(optimizer, model.trainable_variables, model.variables)
        # One optimizer copy per IPU, built on that IPU's variables
        # (`optimizer_copies`). Clipped by the norm over every IPU's gradients
        # before the copies step (`pipelined/update.py`): they do not clip again.
        self.global_clipnorm = optimizer_copies.global_clipnorm(optimizer)
        for ids in self.trainable_of:
            variables = [model.trainable_variables[i] for i in ids]
            clone = optimizer_copies.copy_for(optimizer, variables)
            flat = FlatOptimizer.of(clone, variables)
            order = flat.storage_order if flat else tuple(range(len(clone.variables)))
            in_clone = optimizer_copies.positions(optimizer, clone, model.trainable_variables,
                                                  ids)
            self.optimizers.append(clone)
            self.flat_optimizers.append(flat)
            self.optimizer_storage.append(order)
            self.optimizer_of.append([in_clone[p] for p in order])

    @property
    def loss_scaled(self) -> bool:
        """Whether the optimizer is a `LossScaleOptimizer`.

        Its clones must then skip an update together: one IPU's non-finite
        gradients skip every IPU's update, as one optimizer over all the
        variables skips it.
        """
        return bool(self.optimizers) and isinstance(
            self.model.optimizer, keras.optimizers.LossScaleOptimizer)


def _check_placed(model, trainable_of: list, non_trainable_of: list) -> None:
    """Refuses variables no stage's layer holds, but for the untrainable state of layers
    no stage calls (an unused `Dropout`'s seed), which stays on the host as it is.

    A stage could read the others (a weight the model makes with `add_weight`, a
    `SeedGenerator` of its own) only as the constants of its trace, and the trained
    ones would not train.
    """
    placed = {i for ids in trainable_of for i in ids}
    refused = [v.path for i, v in enumerate(model.trainable_variables) if i not in placed]
    placed = {i for ids in non_trainable_of for i in ids}
    of_layers = {id(v) for layer in model._flatten_layers(include_self=False)
                 for v in layer.non_trainable_variables}
    refused += [v.path for i, v in enumerate(model.non_trainable_variables)
                if i not in placed and id(v) not in of_layers]
    if refused:
        raise ValueError(
            f"Every variable of a pipelined model must belong to a layer of a pipeline "
            f"stage; {refused} belong to none (a weight the model makes with `add_weight`, "
            f"a `SeedGenerator` of the model's own, or a trainable layer no stage calls). "
            f"Make them variables of a layer called inside a `PipelineStage`.")


def _check_built_for(optimizer, trainable: Sequence, variables: Sequence) -> None:
    """Refuses to train weights other than those the optimizer was built for (a layer
    frozen or unfrozen since): `compile()` again makes an optimizer for them, as in Keras.

    A weight that replaced one the model no longer holds, of its shape and dtype
    (a Sequential's `pop()` and `add()`), trains on with its predecessor's
    optimizer state, as in Keras' trainer.
    """
    built_for = optimizer._trainable_variables
    held = {id(v) for v in variables}
    if len(built_for) == len(trainable) and all(
            old is new or (id(old) not in held and tuple(old.shape) == tuple(new.shape)
                           and old.dtype == new.dtype)
            for old, new in zip(built_for, trainable)):
        return
    if len(built_for) != len(trainable):  # Keras' own words
        raise ValueError(
            f"Argument `optimizer_variables` must be a list of tensors corresponding 1:1 to "
            f"the trainable variables list that the optimizer was built with. Received "
            f"len(trainable_variables) == {len(trainable)} whereas the optimizer was built "
            f"with {len(built_for)} variables.")
    raise ValueError(
        f"The model's trainable variables are not those its optimizer was built with "
        f"({', '.join(v.path for v in built_for)}): a layer was frozen or unfrozen since. "
        f"Call compile() again to train the new set.")


def _unique(values: list[int]) -> list[int]:
    return list(dict.fromkeys(values))



# --------------------------------------------------------------------------- state


TRAINING_STATE_PARTS = STATE_PARTS["fit"]


class PipelineState:
    """Packs Keras state into per-IPU flat vectors on the mesh, and back.

    Device form: per part, per dtype, an array `[replicas, ipus, length]`
    sharded over `("replica", "ipu")`: each IPU holds only its own slot.
    """

    def __init__(self, pipelined: PipelinedModel, mesh: IPUMesh, parts: Sequence[str]):
        self.pipelined, self.mesh, self.parts = pipelined, mesh, tuple(parts)
        self.replicas, self.ipus = mesh.devices.shape
        self.sharding = mesh.sharding(P(REPLICA_AXIS, IPU_AXIS))
        self.layouts: dict[str, list[FlatLayout]] = {}
        self.lengths: dict[str, dict[str, int]] = {}
        # Per part: the values of the variables no IPU holds, by index (`to_device`).
        self.held: dict[str, dict[int, Any]] = {}
        # In a multi-host job: the replicas this process runs (its own pipelines).
        self.spans_processes = instances.spans_processes(mesh)
        self.local_replicas = (instances.local_replicas(mesh) if self.spans_processes
                               else tuple(range(self.replicas)))

    def indices(self, part: str, ipu: int) -> list[int]:
        p = self.pipelined
        if part == "trainable_variables":
            return p.trainable_of[ipu]
        if part == "non_trainable_variables":
            return p.non_trainable_of[ipu]
        if part == "optimizer_variables":
            return p.optimizer_of[ipu]
        count = len(p.model.metrics_variables)
        return list(range(count)) if ipu == p.last_ipu else []

    def set_up(self, keras_state: Sequence[Sequence[Any]]) -> None:
        """Works out each part's per-IPU layout from the state's shapes (once, nothing placed)."""
        for part, values in zip(self.parts, keras_state):
            if part not in self.layouts:
                per_ipu = [[values[i] for i in self.indices(part, d)] for d in range(self.ipus)]
                self.layouts[part] = [FlatLayout.of(arrays) for arrays in per_ipu]
                self.lengths[part] = padded_lengths(self.layouts[part])

    def own_bytes(self, ipu: int) -> int:
        """Bytes of the state IPU `ipu` holds of its own (its flats without their padding).

        Example:

        >>> state.own_bytes(1)   # the last stage's weights, slots and metrics
        """
        return sum(size * np.dtype(dtype).itemsize for layouts in self.layouts.values()
                   for dtype, size in layouts[ipu].sizes.items())

    def to_device(self, keras_state: Sequence[Sequence[Any]]) -> dict:
        """Keras state lists -> the packed, placed device form.

        Across instances every replica starts from instance 0's state, and
        each process places the shards of its own devices only.
        """
        self.set_up(keras_state)
        if self.spans_processes:
            keras_state = instances.from_instance_zero(
                [[np.asarray(v) for v in values] for values in keras_state])
        put = instances.place if self.spans_processes else jax.device_put
        packed = {}
        for part, values in zip(self.parts, keras_state):
            values = [np.asarray(v) for v in values]
            # No stage's layer holds them (an unused layer's seed state: `_check_placed`
            # refused the others): the host keeps them as they are.
            held = set(range(len(values))).difference(
                *(self.indices(part, d) for d in range(self.ipus)))
            self.held[part] = {i: values[i] for i in held}
            per_ipu = [[values[i] for i in self.indices(part, d)] for d in range(self.ipus)]
            flats = [layout.pack(arrays, self.lengths[part], xp=np)
                     for layout, arrays in zip(self.layouts[part], per_ipu)]
            packed[part] = {
                dtype: put(
                    np.broadcast_to(np.stack([f[dtype] for f in flats])[None],
                                    (self.replicas, self.ipus, length)),
                    self.sharding,
                )
                for dtype, length in self.lengths[part].items()
            }
        return packed

    def spec(self, keras_state) -> dict:
        """Shape structs of `to_device(keras_state)`, without packing anything."""
        self.set_up(keras_state)
        return {
            part: {
                dtype: jax.ShapeDtypeStruct((self.replicas, self.ipus, length), dtype,
                                            sharding=self.sharding)
                for dtype, length in self.lengths[part].items()
            }
            for part in self.parts
        }

    def to_keras(self, packed: dict, parts: Sequence[str]) -> dict:
        """The device form -> Keras state lists (replica 0; metrics: last replica).

        In a multi-host job, of this instance's replicas: the weights are the
        same on all, and the logs are reduced over all replicas in the program.
        """
        result = {}
        for part in parts:
            mine = self.local_replicas
            replica = mine[-1] if part == "metrics_variables" else mine[0]
            count = _part_length(self.pipelined.model, part)
            values: list = [None] * count
            # From the local shards: `array[replica]` would compile a gather
            # over the sharded array (half a second per dtype on a first fit).
            host = {dtype: instances.replica_row(array, replica)
                    for dtype, array in packed[part].items()}
            for d in self._holders_first(part):
                arrays = self.layouts[part][d].unpack({k: v[d] for k, v in host.items()})
                for i, array in zip(self.indices(part, d), arrays):
                    if values[i] is None:
                        values[i] = array
            for i, array in self.held.get(part, {}).items():
                values[i] = array
            result[part] = values
        return result


    def _holders_first(self, part: str) -> list[int]:
        """The IPUs to take a part's shared values from, those that update them first.

        The optimizer of an IPU without trainable variables never steps, so
        its copy of the shared `iterations` stays where it started.
        """
        ipus = range(self.ipus)
        if part != "optimizer_variables":
            return list(ipus)
        return sorted(ipus, key=lambda d: not self.pipelined.trainable_of[d])


def _part_length(model, part: str) -> int:
    return len({
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": getattr(getattr(model, "optimizer", None), "variables", []),
        "metrics_variables": model.metrics_variables,
    }[part])


# --------------------------------------------------------------------------- stages


def distinct_replica_streams(state: PipelineState) -> bool:
    """Whether the pipeline's replicas draw their own random numbers (the IPU's default).

    `ipu.utils.reset_ipu_seed(..., experimental_identical_replicas=True)` makes
    them draw the same ones.
    """
    return state.replicas > 1 and not ipu_system.require().option("identical_replicas", False)


class StageRunner:
    """Runs one stage's layer calls statelessly on an IPU's packed variables.

    With `distinct_replicas` (traced inside the replicated program), each
    replica draws its own random numbers, as IPU replicas do by default
    (`steps.distinct_random_streams`); replica 0 draws what one pipeline would.
    """

    def __init__(self, pipelined: PipelinedModel, state: PipelineState,
                 distinct_replicas: bool = False):
        self.p, self.state = pipelined, state
        model = pipelined.model
        self.t_index = {id(v): i for i, v in enumerate(model.trainable_variables)}
        self.n_index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self.seeds = (steps.seed_state_indices(model.non_trainable_variables)
                      if distinct_replicas else [])
        self.loss_calls = pipelined.plan.loss_calls  # whose added losses count
        # Each regularized weight counts once, in the first stage that uses it
        # (Keras counts a layer's weight regularization once per model call).
        self.regularized: list[list] = []
        counted: set[int] = set()
        for s in range(pipelined.num_stages):
            own = [i for i in self.own_trainable(s) if i not in counted]
            counted.update(own)
            self.regularized.append([
                (i, model.trainable_variables[i].regularizer) for i in own
                if getattr(model.trainable_variables[i], "regularizer", None) is not None])

    def _unpack(self, part: str, ipu: int, flats) -> dict[int, Any]:
        arrays = self.state.layouts[part][ipu].unpack(flats)
        return dict(zip(self.state.indices(part, ipu), arrays))

    def trainable(self, ipu: int, flats) -> dict[int, Any]:
        """An IPU's trainable variables, by index in `model.trainable_variables`."""
        return self._unpack("trainable_variables", ipu, flats)

    def non_trainable(self, ipu: int, flats) -> dict[int, Any]:
        """An IPU's non-trainable variables, by index in `model.non_trainable_variables`."""
        return self._unpack("non_trainable_variables", ipu, flats)

    def pack_non_trainable(self, ipu: int, ntv: dict[int, Any]) -> dict[str, Any]:
        """The inverse of `non_trainable`."""
        layout = self.state.layouts["non_trainable_variables"][ipu]
        order = self.state.indices("non_trainable_variables", ipu)
        return layout.pack([ntv[i] for i in order],
                           self.state.lengths["non_trainable_variables"])

    def own_trainable(self, s: int) -> list[int]:
        """Indices of the trainable variables of stage `s`'s layers."""
        return _unique([self.t_index[id(v)] for layer in self.p.plan.stage_layers(s)
                        for v in getattr(layer, "trainable_variables", [])])

    def run(self, s: int, trainable, non_trainable, bundle, x, training: bool):
        """`run_with` on an IPU's packed flats: the new non-trainable state packed too."""
        ipu = self.p.device_mapping[s]
        out, ntv, outputs, extra_loss = self.run_with(
            s, self.trainable(ipu, trainable), self.non_trainable(ipu, non_trainable), bundle, x,
            training)
        return out, self.pack_non_trainable(ipu, ntv), outputs, extra_loss

    def run_with(self, s: int, tv: dict[int, Any], ntv: dict[int, Any], bundle, x,
                 training: bool):
        """Runs stage `s` on unpacked variables.

        Returns:
            `(bundle out, new non-trainable dict, outputs, additional loss)`:
            the bundle (`bundle`) for every stage but the last, the
            model's outputs for the last; the additional loss (regularizers,
            `add_loss`, activity regularizers) of the stages so far, which
            the bundle's last row carries on.
        """
        p, plan = self.p, self.p.plan
        seeds = [i for i in self.seeds if i in ntv]
        mask = replica_seed_mask(self.state.mesh.axis_index(REPLICA_AXIS)) if seeds else None
        ntv = xor_seed_words(dict(ntv), seeds, mask)
        env = dict(zip(plan.input_keys, plan.flat_inputs(x)))
        found = p.samples(x)
        offset = 0
        for key in p.bundle_in[s]:
            env[key], offset = boundary.receive(bundle[:-1], offset, plan.tensors[key],
                                                found[key])
        losses = [regularizer(tv[i]) for i, regularizer in self.regularized[s]]
        for call in plan.stages[s]:
            layer = call.operation
            args, kwargs = stages.call_arguments(call, env, training)
            if hasattr(layer, "stateless_call"):
                outputs, new_ntv, call_losses = self._call_layer(layer, tv, ntv, args, kwargs)
                ntv.update(new_ntv)
                losses.extend(call_losses if id(call) in self.loss_calls else [])
            else:  # a plain op in a functional graph
                outputs = layer(*args, **kwargs)
            for key, value in zip(call.output_keys, tree.flatten(outputs)):
                env[key] = value
        ntv = xor_seed_words(ntv, seeds, mask)
        extra_loss = boundary.carried_loss(bundle) + sum(
            (jnp.sum(loss).astype(jnp.float32) for loss in losses), jnp.zeros((), jnp.float32))
        if s == p.num_stages - 1:
            outputs = tree.pack_sequence_as(plan.outputs_struct,
                                            [env[k] for k in plan.output_keys])
            return None, ntv, outputs, extra_loss
        (batch, width), dtype = (bundle.shape[0] - 1, bundle.shape[1]), bundle.dtype  # x's
        out = jnp.concatenate([part for k in p.bundle_out[s] for part in boundary.send(
            env[k], batch, plan.tensors[k], s, found[k], dtype)], axis=1)
        out = jnp.pad(out, ((0, 0), (0, width - out.shape[1])))
        carried = boundary.carry_loss(extra_loss, width, dtype)
        return jnp.concatenate([out, carried], axis=0), ntv, None, extra_loss

    def _call_layer(self, layer, tv, ntv, args, kwargs):
        """A layer call on given variable values: `(outputs, new non-trainables, losses)`.

        Called through `__call__` in a stateless scope (as Keras calls the
        layers of a model in `stateless_call`), so activity regularizers,
        `add_loss` and autocasting apply; the scope collects the losses.
        """
        mapping = [(v, tv[self.t_index[id(v)]]) for v in layer.trainable_variables]
        mapping += [(v, ntv[self.n_index[id(v)]]) for v in layer.non_trainable_variables]
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            outputs = layer(*args, **kwargs)
        new_ntv = {self.n_index[id(v)]: scope.get_current_value(v)
                   for v in layer.non_trainable_variables}
        return outputs, new_ntv, list(scope.losses)


def micro_batch_at(tree_, j):
    return jax.tree_util.tree_map(lambda a: a[j], tree_)


def _receive(buffer, message, sent, stage, micro_batch, mapping, me, stages):
    valid = sent & (stage >= 0) & (stage < stages)
    stage = jnp.clip(stage, 0, stages - 1)
    valid = valid & (mapping[stage] == me)
    current = buffer[stage, micro_batch]
    return buffer.at[stage, micro_batch].set(jnp.where(valid, message, current))


def _table_arrays(table: schedules.ScheduleTable):
    kinds = np.zeros((table.num_ticks, table.num_ipus), np.int32)
    stage = np.zeros_like(kinds)
    micro = np.zeros_like(kinds)
    for t, row in enumerate(table.ticks):
        for ipu, op in enumerate(row):
            if op is not None:
                kinds[t, ipu] = FORWARD if op.phase == "F" else BACKWARD
                stage[t, ipu], micro[t, ipu] = op.stage, op.micro_batch
    return jnp.asarray(kinds), jnp.asarray(stage), jnp.asarray(micro)


def build_inference_program(pipelined: PipelinedModel, state: PipelineState,
                            table: schedules.ScheduleTable, mode: str):
    """Evaluate or predict: forward ops only, `micro_batches = steps_per_execution`.

    `(packed state, batches) -> (packed state, outfeed)`: batches as in
    `training.build_fit_program` with one update; the outfeed is the per-step logs
    (evaluate) or outputs (predict), `[1, replicas, steps, ...]`.
    """
    p, model = pipelined, pipelined.model
    runner = StageRunner(pipelined, state, distinct_replica_streams(state))
    stages, micro = p.num_stages, table.num_micro_batches
    ticks = _table_arrays(table)
    mapping = jnp.asarray(p.device_mapping, jnp.int32)
    parts = state.parts
    metrics_layout = state.layouts.get("metrics_variables", [None] * p.num_ipus)[p.last_ipu]

    def last(trainable, non_trainable, metrics, bundle, batch):
        x, y, sample_weight = batch
        _, non_trainable, y_pred, extra_loss = runner.run(stages - 1, trainable, non_trainable,
                                                          bundle, x, False)
        if mode == "predict":
            return y_pred, non_trainable, metrics
        last_weights = runner.trainable(p.device_mapping[-1], trainable)
        if not p.adds_losses(x):
            extra_loss = None  # `model.losses` is empty, as plain Keras' in `evaluate`
        loss, metrics_vars = stage_loss(model, metrics_layout.unpack(metrics), batch, y_pred,
                                        extra_loss, training=False, weights={
                                            i: last_weights[i]
                                            for i in runner.own_trainable(stages - 1)})
        logs, metrics_vars = model._update_metrics_variables(metrics_vars, loss, x, y, y_pred,
                                                             sample_weight)
        return logs, non_trainable, metrics_layout.pack(
            metrics_vars, state.lengths["metrics_variables"])

    def per_replica(packed, batches):
        local = jax.tree_util.tree_map(lambda a: a[0, 0], packed)
        data = jax.tree_util.tree_map(lambda a: a[0, 0], batches)
        me = state.mesh.axis_index(IPU_AXIS)
        trainable = local["trainable_variables"]
        non_trainable = local["non_trainable_variables"]
        metrics = local.get("metrics_variables", {})
        bundle = p.bundle(micro_batch_at(data, 0)[0])
        fwd = jnp.zeros((stages, micro, *bundle.shape), bundle.dtype)
        out_shape = jax.eval_shape(
            lambda: last(trainable, non_trainable, metrics, fwd[0, 0], micro_batch_at(data, 0)))[0]
        outputs = jax.tree_util.tree_map(
            lambda leaf: jnp.zeros((micro, *leaf.shape), leaf.dtype), out_shape)

        def forward(s):
            def op(c, j):
                non_trainable, metrics, fwd, outputs = c
                batch = micro_batch_at(data, j)
                if s == stages - 1:
                    result, non_trainable, metrics = last(trainable, non_trainable, metrics,
                                                          fwd[s, j], batch)
                    outputs = jax.tree_util.tree_map(lambda b, v: b.at[j].set(v), outputs,
                                                      result)
                    message = jnp.zeros(bundle.shape, bundle.dtype)
                else:
                    message, non_trainable, _, _ = runner.run(s, trainable, non_trainable,
                                                           fwd[s, j], batch[0], False)
                return (non_trainable, metrics, fwd, outputs), message
            return op

        def idle(c, j):
            return c, jnp.zeros(bundle.shape, bundle.dtype)

        branches = [idle] + [forward(s) for s in range(stages)]

        def tick(c, row):
            kinds, stage_of, micro_of = row
            kind, s, j = kinds[me], stage_of[me], micro_of[me]
            c, message = state.mesh.switch(IPU_AXIS, jnp.where(kind == FORWARD, 1 + s, 0),
                                           branches, c, j)
            non_trainable, metrics, fwd, outputs = c
            messages = state.mesh.all_gather(message, IPU_AXIS)
            for i in range(p.num_ipus):
                fwd = _receive(fwd, messages[i], kinds[i] == FORWARD, stage_of[i] + 1,
                               micro_of[i], mapping, me, stages)
            return (non_trainable, metrics, fwd, outputs), None

        (non_trainable, metrics, _, outputs), _ = jax.lax.scan(
            tick, (non_trainable, metrics, fwd, outputs), ticks)
        # The last IPU's outputs, in their types (a psum makes booleans int32).
        outputs = jax.tree_util.tree_map(
            lambda a, mine: a.astype(mine.dtype), state.mesh.psum(
                jax.tree_util.tree_map(lambda a: jnp.where(me == p.last_ipu, a, 0), outputs),
                IPU_AXIS), outputs)
        new = {"trainable_variables": trainable, "non_trainable_variables": non_trainable}
        if "metrics_variables" in parts:
            new["metrics_variables"] = metrics
        new = {part: jax.tree_util.tree_map(lambda a: a[None, None], new[part]) for part in parts}
        return new, jax.tree_util.tree_map(lambda a: a[None, None], outputs)

    return state.mesh.map(
        per_replica,
        in_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
        out_specs=(P(REPLICA_AXIS, IPU_AXIS), P(None, REPLICA_AXIS)),
    )
