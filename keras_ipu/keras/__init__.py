"""IPU specific Keras integration (the `keras.ipu` namespace of IPU TensorFlow)."""

from __future__ import annotations

import importlib

_SUBMODULES = ("callbacks", "extensions", "layers")
_LAZY_NAMES = {
    "PipelineStage": "keras_ipu.keras.stages",
    "SequentialLayerPipelineStageAssignment": "keras_ipu.keras.stages",
    "FunctionalLayerPipelineStageAssignment": "keras_ipu.keras.stages",
    "ModelLayerPipelineStageAssignment": "keras_ipu.keras.stages",
    "NestedModelPipelineStageAssignment": "keras_ipu.keras.stages",
    "FunctionalNestedModelPipelineStageAssignment": "keras_ipu.keras.stages",
    "SequentialNestedModelPipelineStageAssignment": "keras_ipu.keras.stages",
    "ReplicatedMetricReductionMethod": "keras_ipu.keras.options",
    "FunctionalExtension": "keras_ipu.keras.extensions",
    "ModelExtension": "keras_ipu.keras.extensions",
    "SequentialExtension": "keras_ipu.keras.extensions",
}

__all__ = [*_SUBMODULES, *_LAZY_NAMES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_ipu.keras.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'keras_ipu.keras' has no attribute {name!r}")
