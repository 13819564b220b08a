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
import importlib.abc
import importlib.util
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

# The modules whose layers are registered with Keras' serialization, so that
# `keras.models.load_model` finds them (recurrent_ops imports layers, which
# imports group_normalization).
_REGISTERING_MODULE = "keras_ipu.keras.recurrent_ops"


class _RegisterAfterKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers keras_ipu's layers with Keras as soon as Keras is imported.

    keras_ipu does not import Keras itself (the import stays light, and
    Keras' backend is chosen first); a model saved with IPU layers must
    still load after `import keras_ipu`, as with IPU TensorFlow, without
    importing the layers' module by hand.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)  # once, and the real finders find Keras
        spec = importlib.util.find_spec("keras")
        if spec is not None and spec.loader is not None:
            self._keras_loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._keras_loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self._keras_loader
        self._keras_loader.exec_module(module)
        importlib.import_module(_REGISTERING_MODULE)


if "keras" in sys.modules:
    importlib.import_module(_REGISTERING_MODULE)
elif not any(isinstance(finder, _RegisterAfterKeras) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterKeras())

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
