"""Serving (the `ipu.serving` namespace of IPU TensorFlow): export models, run exports.

`export_keras` writes an export of a model created in an `IPUStrategy`
(Keras needed); `load` runs one and imports neither Keras nor the rest of
keras_ipu's Keras integration, so a serving process stays light.

Example:

>>> runtime = keras_ipu.serving.export_keras(model, "my_export", batch_size=1)
>>> keras_ipu.serving.load("my_export")(np.ones((1, 4), "float32"))
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_NAMES = {
    "load": "keras_ipu.serving.runtime",
    "ServingRuntime": "keras_ipu.serving.runtime",
}

__all__ = ["export_keras", *_LAZY_NAMES]


def export_keras(model: Any, export_dir: str, batch_size: int | None = None,
                 output_names: Any = None, preprocessing_step: Any = None,
                 preprocessing_step_signature: Any = None, postprocessing_step: Any = None,
                 postprocessing_step_signature: Any = None, purge_export_dir: bool = False,
                 platforms: Any = None) -> Any:
    """Exports a Keras model for serving; the same as `model.export_for_ipu_serving`.

    Args:
        model: A built model created in an `IPUStrategy` scope.
        export_dir: An empty (or missing) directory.
        batch_size: The batch size of the exported program (needed when the
            model's inputs do not fix it).
        output_names: A name, or one per output (default `output_0`, ...;
            a dict of outputs is served under its keys, renamed in its order).
        preprocessing_step: A JAX-traceable function of the inputs, run
            before the model.
        preprocessing_step_signature: The inputs of
            `preprocessing_step`, which become the export's: specs with a
            `shape` (a leading `None` is the batch size) and a `dtype`
            (`jax.ShapeDtypeStruct`, `keras.Input`, `tf.TensorSpec`). Without
            it, the export takes the model's inputs.
        postprocessing_step: A JAX-traceable function of the outputs, run
            after it.
        postprocessing_step_signature: Accepted for ported code (the
            outputs' signature is traced from the program).
        purge_export_dir: Empty a non-empty `export_dir` first.
        platforms: The platforms the export runs on (default: this one),
            e.g. `("cpu", "cuda")`.

    Returns:
        The `ServingRuntime` of the export.

    Raises:
        ValueError: Model not created in an IPUStrategy, unknown batch size,
            non-empty directory.
        RuntimeError: Model not built.

    Example:

    >>> runtime = export_keras(model, "my_export", batch_size=1)
    """
    from keras_ipu.keras import export

    return export.export_model(model, export_dir, batch_size, output_names, preprocessing_step,
                               postprocessing_step, purge_export_dir, platforms,
                               preprocessing_step_signature=preprocessing_step_signature)


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'keras_ipu.serving' has no attribute {name!r}")
