"""The multi-instance strategies: `IPUStrategy` whose replicas span every instance."""

from __future__ import annotations

from typing import Any

import jax

from keras_ipu.device import compiled_calls
from keras_ipu.distributed import config as distributed_config
from keras_ipu.distributed import runtime
from keras_ipu.keras.strategy import IPUStrategy


class IPUMultiReplicaStrategy(IPUStrategy):
    """An `IPUStrategy` whose models' replicas span all instances of the job.

    Each instance configures its own IPUs (`configure_ipu_system`, e.g.
    after `update_ipu_config`); a model's global replicas are then
    `num_instances() × local replicas`, global replica
    `instance × local replicas + local replica`. `fit`, `evaluate` and
    `predict` run one program over all instances' devices: gradients are
    summed over all global replicas (as with replicas in one process),
    metrics reduced over them as `set_replication_options` says, and the
    initial weights come from instance 0. Each instance feeds its own data:
    its j-th batch goes to its local replica `j % local replicas`.

    Creating the strategy joins the job's distributed runtime when
    `configure_ipu_system` has not already done so.

    Args:
        ipu_device: The logical IPU device the models run on.
        add_ipu_cross_replica_reductions: Must be `True` (the seed's
            default): gradients are always summed over the global replicas.
        **kwargs: The other `IPUStrategy` arguments.

    Raises:
        ValueError: When `add_ipu_cross_replica_reductions` is `False`.

    Example:

    >>> config = keras_ipu.config.IPUConfig()
    >>> keras_ipu.distributed.update_ipu_config(config)   # under `keras-ipu run`
    >>> config.configure_ipu_system()
    >>> strategy = keras_ipu.distributed.IPUMultiReplicaStrategy()
    """

    def __init__(self, ipu_device: str = "/device:IPU:0",
                 add_ipu_cross_replica_reductions: bool = True, **kwargs: Any):
        if not add_ipu_cross_replica_reductions:
            raise ValueError(
                "add_ipu_cross_replica_reductions=False is not supported: keras_ipu's "
                "programs sum the gradients over all global replicas. Leave it True.")
        runtime.initialize()
        super().__init__(ipu_device=ipu_device, **kwargs)

    def update_ipu_config(self, config: Any) -> Any:
        """Updates `config` with the multi-replica distribution options: the
        instances' count and this one's index, and this instance's share of the job's IPUs.

        Args:
            config: An `IPUConfig`, changed in place.

        Returns:
            `config` (see `keras_ipu.distributed.update_ipu_config`).

        Example:

        >>> strategy.update_ipu_config(keras_ipu.config.IPUConfig()).configure_ipu_system()
        """
        return distributed_config.update_ipu_config(config)

    @property
    def num_instances(self) -> int:
        """The number of instances in the job."""
        return runtime.num_instances()

    @property
    def instance_index(self) -> int:
        """This instance's index."""
        return runtime.instance_index()

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Reduces `value` over the replicas, over `axis`, and over the instances.

        Inside `run`'s function, over this instance's replicas (as `IPUStrategy`'s);
        outside it, over every instance too (each must call it), as the seed's
        multi-worker strategy reduces a per-worker value across the workers.

        Args:
            reduce_op: `"SUM"` or `"MEAN"` (or an enum member of that name).
            value: An array, or a tree of arrays (the same shapes on every instance).
            axis: An axis of each array to reduce too, or `None`.

        Returns:
            The reduced value (NumPy arrays, across instances).

        Raises:
            ValueError: For another `reduce_op`, or values that differ in shape
                between the instances.

        Example:

        >>> strategy.reduce("SUM", np.float32(instance_index() + 1))   # 2 instances
        array(3., dtype=float32)
        """
        reduced = super().reduce(reduce_op, value, axis)
        if (runtime.num_instances() == 1 or compiled_calls.in_compiled_program()
                or any(isinstance(leaf, jax.core.Tracer)
                       for leaf in jax.tree_util.tree_leaves(reduced))):
            return reduced  # traced (in `run`, or the caller's own jit): this instance's
        name = str(getattr(reduce_op, "name", reduce_op)).lower()
        return runtime.allreduce(jax.device_get(reduced), op=name)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ipu_device={self.ipu_device!r}, "
                f"instances={runtime.num_instances()})")


class IPUMultiWorkerStrategy(IPUMultiReplicaStrategy):
    """The seed's `IPUMultiWorkerStrategy(cluster_resolver)`, on JAX's distributed runtime.

    Args:
        cluster_resolver: Accepted for compatibility and ignored: the
            instances find each other through the launcher's environment or
            the cluster's own (SLURM, Open MPI), as `jax.distributed` does.
        ipu_device: The logical IPU device the models run on.
        variables_on_host: Must be `False`: variables live on the IPUs.

    Raises:
        ValueError: When `variables_on_host` is `True`.

    Example:

    >>> strategy = IPUMultiWorkerStrategy()
    """

    def __init__(self, cluster_resolver: Any = None, ipu_device: str = "/device:IPU:0",
                 variables_on_host: bool = False, **kwargs: Any):
        if variables_on_host:
            raise ValueError(
                "variables_on_host=True is not supported: keras_ipu keeps the variables "
                "on the IPUs and sums gradients over the replicas in the program. Leave "
                "variables_on_host=False.")
        self.cluster_resolver = cluster_resolver
        super().__init__(ipu_device=ipu_device, **kwargs)


class IPUHorovodStrategy(IPUMultiWorkerStrategy):
    """The seed's `IPUHorovodStrategy(ipu_device, variables_on_host)`: no cluster resolver.

    Args:
        ipu_device: The logical IPU device the models run on.
        variables_on_host: Must be `False`: variables live on the IPUs.

    Raises:
        ValueError: When `variables_on_host` is `True`.

    Example:

    >>> strategy = IPUHorovodStrategy()
    """

    def __init__(self, ipu_device: str = "/device:IPU:0", variables_on_host: bool = False,
                 **kwargs: Any):
        super().__init__(None, ipu_device=ipu_device, variables_on_host=variables_on_host,
                         **kwargs)
