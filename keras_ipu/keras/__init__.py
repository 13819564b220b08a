"""IPU specific Keras integration (the `keras.ipu` namespace of IPU TensorFlow)."""

from __future__ import annotations

import importlib

_SUBMODULES = ("extensions",)

__all__ = list(_SUBMODULES)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_ipu.keras.{name}")
    raise AttributeError(f"module 'keras_ipu.keras' has no attribute {name!r}")
