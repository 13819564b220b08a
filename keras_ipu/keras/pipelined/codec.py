"""A pipelined run's mesh, and how its state, batches and outfeed move to and from it.

`pipeline_mesh` lays the replicas' pipelines out as a `("replica", "ipu")`
grid; `PipelineCodec` moves Keras state and host batches onto it (across
instances in a multi-host job, see `instances`); `PipelineLayout` arranges
the feed's batches for the program and its outfeed for the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from keras_ipu.device import accounting
from keras_ipu.device.mesh import IPUMesh
from keras_ipu.keras.pipelined import instances
from keras_ipu.keras.pipelined.model import IPU_AXIS, REPLICA_AXIS, PipelineState


def pipeline_mesh(ipus: Sequence[Any], ipus_per_replica: int, used_per_replica: int) -> IPUMesh:
    """A `("replica", "ipu")` grid: replica r uses IPUs `r·k .. r·k + used - 1`.

    IPUs that share a JAX device run batched on it (see `device.mesh`).
    """
    replicas = len(ipus) // ipus_per_replica
    rows = [[ipus[r * ipus_per_replica + i].device for i in range(used_per_replica)]
            for r in range(replicas)]
    return IPUMesh(np.array(rows, dtype=object), (REPLICA_AXIS, IPU_AXIS))


class PipelineCodec:
    """Moves state and batches between Keras and a pipelined program.

    Args:
        state: The packed state layout on the pipeline mesh.

    Example:

    >>> codec = PipelineCodec(state)
    >>> packed = codec.to_device(keras_state)     # across instances: instance 0's state
    >>> batches = codec.place(layout.to_program(host_batches))
    """

    def __init__(self, state: PipelineState):
        self.state = state
        self.batch_sharding = state.mesh.sharding(P(None, REPLICA_AXIS))
        # The trainable weights the program was built for (a layer frozen since is not).
        self._trainable = list(state.pipelined.model.trainable_variables)

    def to_device(self, keras_state: Any) -> dict:
        """Keras state lists -> the packed state on the mesh (`PipelineState.to_device`)."""
        return self.state.to_device(keras_state)

    def spec(self, keras_state: Any) -> dict:
        """Shape structs of `to_device(keras_state)`."""
        return self.state.spec(keras_state)

    def to_keras(self, packed: dict) -> dict:
        """The packed state -> Keras state lists (`PipelineState.to_keras`)."""
        return self.state.to_keras(packed, self.state.parts)

    def with_metrics_of(self, packed: dict, previous: dict) -> dict:
        """`packed` with the metric states each replica has in `previous`."""
        return {**packed, "metrics_variables": previous["metrics_variables"]}

    def batch_spec(self, batches: Any) -> Any:
        """Shape structs of an execution's placed (global) batches."""
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.batch_sharding),
            batches)

    def weight_devices(self, model: Any) -> list[tuple[Any, list]]:
        """`(weight, devices)` for each trainable weight of the program, in order: its
        stage's IPU, in every replica (`model`'s as the program was built for it)."""
        del model  # its weights now may differ (a layer frozen since)
        devices, held = self.state.mesh.devices, [[] for _ in self._trainable]
        for ipu, indices in enumerate(self.state.pipelined.trainable_of):
            for i in indices:
                held[i] = list(devices[:, ipu])
        return list(zip(self._trainable, held))

    @property
    def lone_replica(self) -> bool:
        """Whether this instance runs one replica of several: its feed has no replica axis."""
        return self.state.spans_processes and len(self.state.local_replicas) == 1

    def place(self, batches: Any) -> Any:
        """An execution's program-shaped host batches on the mesh's devices."""
        if self.state.spans_processes:  # each instance brings its own replicas' batches
            return instances.global_batches(batches, self.batch_sharding, self.state.replicas)
        if all(d.platform == "cpu" for d in self.state.mesh.devices.flat):
            return batches  # the dispatch copies host arrays (see Replicas.place_batches)
        return jax.device_put(batches, self.batch_sharding)


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Data and outfeed arrangement of pipelined programs.

    The feed gives `[steps, (replicas,) batch, ...]`; the program takes
    `[updates, replicas, micro_batches, batch, ...]` as `(x, y, sample_weight)`.
    With `everywhere` (a multi-host job: a sharding that replicates over the
    whole mesh) the outfeed is made whole on every device, so that every
    instance reads it, and predictions stay `[steps, replicas, batch, ...]`
    for each instance to take its own replicas' rows.
    """

    replicas: int
    micro_batches: int
    everywhere: Any = None

    def to_program(self, batches):
        batches = tuple(batches) + (None,) * (3 - len(batches))
        return jax.tree_util.tree_map(self._group, batches)

    def _group(self, a):
        if self.replicas == 1:
            a = a[:, None]
        grouped = a.reshape(a.shape[0] // self.micro_batches, self.micro_batches, *a.shape[1:])
        return np.swapaxes(grouped, 1, 2)

    def micro_batch(self, batches):
        """Shape structs of one micro-batch `(x, y, sample_weight)` of the program's batches.

        Example:

        >>> x, y, sample_weight = layout.micro_batch(layout.to_program(host_batches))
        """
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[3:], a.dtype),
                                      batches)

    def finalize(self, mode: str, reduce, accumulate_outfeed: bool = False):
        """The in-program outfeed transform for a mode (`reduce`: replica reduction).

        With `accumulate_outfeed`, the logs of the last pass through the
        pipeline are averaged over its micro-batches (the reference sums them
        on the device and divides by the accumulation steps, or by
        `steps_per_execution` when evaluating: the micro-batches of a pass).
        """
        if mode == "predict" and self.everywhere is not None:
            return lambda out: self._whole(jax.tree_util.tree_map(
                lambda a: jnp.swapaxes(a[0], 0, 1), out))
        if mode == "predict":
            return lambda out: jax.tree_util.tree_map(
                lambda a: jnp.swapaxes(a[0], 0, 1).reshape(-1, *a.shape[4:]), out)

        def last_logs(out):
            # `a[-1]` is `[replicas, micro-batches, ...]` (a metric may be a vector).
            pick = (lambda a: jnp.mean(a[-1], axis=1)) if accumulate_outfeed else (
                lambda a: a[-1, :, -1])
            last = jax.tree_util.tree_map(pick, out)
            if self.replicas == 1:
                return jax.tree_util.tree_map(lambda a: a[0], last)
            return self._whole(jax.tree_util.tree_map(reduce, last))

        return last_logs

    def _whole(self, tree):
        """`tree` on every device of the mesh (in a multi-host job), else unchanged."""
        if self.everywhere is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.everywhere)

    def with_steps(self, finalize):
        """`finalize` that also returns every micro-batch's logs, `[updates, replicas, micro]`."""
        return lambda out: (finalize(out), self._whole(out))

    def predictions_by_step(self, steps: int):
        """`predictions -> (predictions, [steps, replicas, batch, ...])`, from the input order."""

        def split(predictions):
            def by_step(a):
                if self.everywhere is not None:  # already `[steps, replicas, batch, ...]`
                    return np.asarray(a)
                return np.asarray(a).reshape(steps, self.replicas, -1, *a.shape[1:])

            return predictions, jax.tree_util.tree_map(by_step, predictions)

        return split


def io_by_ipu(device_mapping: Sequence[int], num_ipus: int, replicas: int,
              batches: Any, outfeed: Any) -> tuple[int, ...]:
    """Per IPU (replica by replica), the bytes of `(x, y, sample_weight)` batches and an
    outfeed it streams: the first stage's IPU takes the inputs, the last stage's the targets,
    the sample weights and the outfeed (logs or predictions); the others exchange activations.

    Args:
        device_mapping: Per stage, its IPU within a replica.
        num_ipus: The IPUs of a replica.
        replicas: The replicas the batches and outfeed are of.
        batches: An execution's `(x, y, sample_weight)` (arrays or shape structs).
        outfeed: Its outfeed.

    Returns:
        Bytes per IPU, `replicas × num_ipus` of them.

    Example:

    >>> io_by_ipu([0, 1], 2, 1, (x, y, None), logs)   # (bytes of x, of y and the logs)
    """
    share = [0] * num_ipus
    share[device_mapping[0]] += accounting.tree_bytes(batches[0]) // replicas
    share[device_mapping[-1]] += accounting.tree_bytes((batches[1:], outfeed)) // replicas
    return tuple(share) * replicas
