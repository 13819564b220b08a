"""`IPUStrategy` and its scope: the top of `keras_ipu.keras`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_ipu.device import compiled_calls
from keras_ipu.device import scopes as device_scopes
from keras_ipu.device import system as ipu_system
from keras_ipu.keras import assignments, context, extensions, options, replica_gradients


class IPUStrategy:
    """Runs Keras models created in its scope on the configured IPU system.

    Inside `strategy.scope()`, every Keras model that is created
    (Sequential, Functional, subclassed, nested) gains the IPU extension
    class of its kind (`keras_ipu.keras.extensions.SequentialExtension`,
    `FunctionalExtension` or `ModelExtension`); its `fit`, `evaluate` and
    `predict` then run on the IPU system, also when called outside the
    scope. Models created outside the scope are not changed.

    Args:
        ipu_device: The logical IPU device the models run on
            (`"/device:IPU:0"`, the first device of the configured system).
        cpu_device: The host device; accepted for compatibility.
        enable_dataset_iterators: Accepted for compatibility; keras_ipu
            always feeds data through its own infeed.
        enable_keras_extensions: Whether models created in the scope gain
            the IPU extensions. With `False`, models stay plain Keras models.

    Raises:
        ValueError: For an `ipu_device` that names no IPU device.
        TypeError: For a flag that is no bool.

    Example:

    >>> strategy = keras_ipu.ipu_strategy.IPUStrategy()
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.layers.Dense(4)])
    >>> isinstance(model, keras_ipu.keras.extensions.SequentialExtension)
    True
    """

    def __init__(
        self,
        ipu_device: str = "/device:IPU:0",
        cpu_device: str = "/device:CPU:0",
        enable_dataset_iterators: bool = True,
        enable_keras_extensions: bool = True,
    ):
        if not isinstance(ipu_device, str) or not ipu_device.startswith("/device:IPU:"):
            raise ValueError(
                f"ipu_device must name a logical IPU device such as "
                f"'/device:IPU:0', got {ipu_device!r}."
            )
        self.ipu_device = ipu_device
        self.cpu_device = cpu_device
        # Checked: "False" was read as true.
        self.enable_dataset_iterators = options.checked_flag("enable_dataset_iterators",
                                                             enable_dataset_iterators)
        self.enable_keras_extensions = options.checked_flag("enable_keras_extensions",
                                                            enable_keras_extensions)
        # Models are redirected when they are created, and optimizers applied in a
        # replicated `run` reduce their gradients: hooks installed when a strategy exists.
        _install_hooks()

    @property
    def num_replicas_in_sync(self) -> int:
        """1: replication happens inside the compiled program, as on IPUs."""
        return 1

    def __setstate__(self, state: dict) -> None:
        # Unpickled (in another process, say), `__init__` does not run: the hooks must.
        self.__dict__.update(state)
        _install_hooks()

    @contextlib.contextmanager
    def scope(self) -> Iterator[IPUStrategy]:
        """A context in which created Keras models run on the IPU system."""
        with context.strategy_scope(self):
            yield self

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs `fn(*args, **kwargs)` compiled on the strategy's IPU device, replicated.

        As `tf.distribute.Strategy.run` in IPU TensorFlow, where `fn` is
        compiled for the IPU: here it is compiled with `jax.jit` (it must be
        JAX-traceable: `keras.ops`, `jax.numpy`, stateless Keras calls) and
        runs on the JAX devices of the IPUs of `ipu_device`. As on the IPU,
        the program is replicated over the device's IPUs: one replica per
        shard count of IPUs (one IPU each unless `fn` enters
        `ipu.scopes.ipu_shard`). Every replica gets the array arguments; a
        loop over an infeed takes iterations × replicas elements, iteration k
        of replica r element k × replicas + r; `replication_index()` and the
        cross-replica ops see the replicas. Values that `ipu.loops` inside
        enqueue to an `IPUOutfeedQueue` reach it once `fn` has run (its
        `dequeue` returns them, with a replica axis second when there are
        several replicas); so do values `fn` enqueues outside any loop, one
        element per run. Keras variables `fn` assigns (BatchNormalization's
        moving statistics in training mode, a seed generator's state) take
        their new values once it has run, replica 0's. A Keras optimizer
        applied in `fn` sums the replicas' gradients first, as IPU
        TensorFlow's strategy does.
        `num_replicas_in_sync` stays 1, as in IPU TensorFlow: the
        replication is inside the program.

        Args:
            fn: The function to run.
            args: Its positional arguments.
            kwargs: Its keyword arguments.

        Returns:
            `fn`'s result (JAX arrays on the first IPU's device): replica 0's,
            as replicas hold equal values after cross-replica reductions; the
            outfeeds show every replica's.

        Raises:
            RuntimeError: When no IPU system is configured.
            ValueError: When the configured system has no `ipu_device`, an
                infeed runs out (nothing is taken), or the device's IPUs are
                not a multiple of the shards `fn` uses.

        Example:

        >>> strategy.run(lambda x: x * 2, args=(np.ones(3),))
        Array([2., 2., 2.], dtype=float32)
        """
        ipus = ipu_system.require().ipus_of_device(self.ipu_device)
        # `ipu_shard(i)` is of the device's IPUs.
        with device_scopes.ipu_scope(self.ipu_device), _distribution_named(len(ipus)):
            return assignments.call_assigning(
                lambda traced: compiled_calls.call_compiled(traced, ipus, args, kwargs,
                                                            name="strategy.run"), fn)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Reduces `value` over the replicas, and over `axis`.

        Inside `run`'s function: over the program's replicas
        (`cross_replica_sum`, or its mean), as IPU TensorFlow's strategy
        reduces on the device; outside it, over one replica, as
        `num_replicas_in_sync` says.

        Args:
            reduce_op: `"SUM"` or `"MEAN"` (or an enum member of that name,
                such as TensorFlow's `ReduceOp.SUM`).
            value: An array, or a tree of arrays.
            axis: An axis of each array to reduce too, or `None`.

        Returns:
            The reduced value.

        Raises:
            ValueError: For another `reduce_op`.

        Example:

        >>> strategy.reduce("SUM", np.ones((4, 2)), axis=0)
        Array([4., 4.], dtype=float32)
        """
        import jax
        import jax.numpy as jnp

        name = str(getattr(reduce_op, "name", reduce_op)).upper()
        reductions = {"SUM": jnp.sum, "MEAN": jnp.mean}
        if name not in reductions:
            raise ValueError(f"Unknown reduce_op {reduce_op!r}; valid: SUM, MEAN.")
        value = replica_gradients.reduce_over_replicas(name, value)
        if axis is None:
            return value
        return jax.tree_util.tree_map(lambda v: reductions[name](v, axis=axis), value)

    def __repr__(self) -> str:
        return (
            f"IPUStrategy(ipu_device={self.ipu_device!r}, "
            f"enable_keras_extensions={self.enable_keras_extensions})"
        )


IPUStrategyV1 = IPUStrategy


def _install_hooks() -> None:
    extensions.install()
    replica_gradients.install()


@contextlib.contextmanager
def _distribution_named(ipus: int) -> Iterator[None]:
    """Names `keras.distribution` in what JAX raises when its variables meet the replicas.

    A distribution set with `keras.distribution.set_distribution` lays the
    variables out over its own device mesh; `fn` reads them inside the
    program replicated over the IPUs, where JAX cannot differentiate through
    values of that layout (`fit` passes the variables in, and is unaffected).
    """
    try:
        yield
    except ValueError as error:
        distribution = keras.distribution.distribution()
        if distribution is None or ipus < 2 or "mesh" not in str(error):
            raise
        raise ValueError(
            f"strategy.run could not run `fn` over {ipus} IPU replicas while a Keras "
            f"distribution ({type(distribution).__name__}) lays out the variables it reads "
            f"over its own devices. Run it without the distribution "
            f"(`keras.distribution.set_distribution(None)`): the IPUStrategy replicates "
            f"the program itself. JAX said: {str(error).splitlines()[0]}") from error
