"""keras_ipu: Graphcore's "Keras with IPUs" programming model on Keras 3 and JAX.

Code written for IPU TensorFlow 2 Keras runs after changing its imports:

    import keras_ipu as ipu

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
        model.fit(x, y, batch_size=32)

Importing keras_ipu selects Keras' JAX backend when Keras is not imported yet.
Submodules load on first use, so the import stays light.
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"


def _select_jax_backend() -> None:
    # keras_ipu is an add-on to Keras' JAX backend: a third-party backend name
    # cannot be registered, so the JAX backend must be the one Keras runs.
    keras = sys.modules.get("keras")
    if keras is not None:
        backend = keras.config.backend() if hasattr(keras, "config") else None
        if backend is not None and backend != "jax":
            raise ImportError(
                f"keras_ipu runs on Keras' JAX backend, but Keras was already "
                f"imported with the {backend!r} backend. Import keras_ipu before "
                f"keras, or set the environment variable KERAS_BACKEND=jax "
                f"before Python starts."
            )
        return
    requested = os.environ.get("KERAS_BACKEND")
    if requested and requested != "jax":
        raise ImportError(
            f"keras_ipu runs on Keras' JAX backend, but KERAS_BACKEND is "
            f"{requested!r}. Unset KERAS_BACKEND or set it to 'jax'."
        )
    os.environ["KERAS_BACKEND"] = "jax"


_select_jax_backend()

from keras_ipu import layer_registration  # noqa: E402 (after the backend is chosen)

# Keras' `load_model` finds keras_ipu's layers once Keras is imported.
layer_registration.install()

_SUBMODULES = (
    "config",
    "dataset_benchmark",
    "device",
    "distributed",
    "errors",
    "functional_ops",
    "gradient_accumulation",
    "horovod",
    "ipu_compiler",
    "ipu_infeed_queue",
    "ipu_multi_worker_strategy",
    "ipu_outfeed_queue",
    "ipu_strategy",
    "keras",
    "loops",
    "ops",
    "pipelining_ops",
    "scopes",
    "serving",
    "utils",
)
# IPU TensorFlow's operator modules, also under `ipu.ops`.
_OPS = ("all_to_all_op", "cross_replica_ops", "embedding_ops", "image_ops", "internal_ops",
        "math_ops", "nn_ops", "normalization_ops", "rand_ops", "reduce_scatter_op",
        "replication_ops", "rnn_ops",
        "slicing_ops", "statistics_ops")
_LAZY_NAMES = {
    "IPUStrategy": ("keras_ipu.ipu_strategy", "IPUStrategy"),
    "IPUOutOfMemoryError": ("keras_ipu.errors", "IPUOutOfMemoryError"),
    "PipelineStage": ("keras_ipu.keras.stages", "PipelineStage"),
    "outlined_function": ("keras_ipu.functional_ops", "outlined_function"),
}

__all__ = [*_SUBMODULES, *_OPS, *_LAZY_NAMES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_ipu.{name}")
    if name in _OPS:
        return importlib.import_module(f"keras_ipu.ops.{name}")
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'keras_ipu' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
