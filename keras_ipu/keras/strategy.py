"""`IPUStrategy` and its scope: the top of `keras_ipu.keras`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from keras_ipu.keras import context, extensions


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
        self.enable_dataset_iterators = bool(enable_dataset_iterators)
        self.enable_keras_extensions = bool(enable_keras_extensions)
        # Models are redirected when they are created; the hook is installed
        # the first time a strategy exists.
        extensions.install()

    @property
    def num_replicas_in_sync(self) -> int:
        """1: replication happens inside the compiled program, as on IPUs."""
        return 1

    @contextlib.contextmanager
    def scope(self) -> Iterator[IPUStrategy]:
        """A context in which created Keras models run on the IPU system."""
        with context.strategy_scope(self):
            yield self

    def __repr__(self) -> str:
        return (
            f"IPUStrategy(ipu_device={self.ipu_device!r}, "
            f"enable_keras_extensions={self.enable_keras_extensions})"
        )


IPUStrategyV1 = IPUStrategy
