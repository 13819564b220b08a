"""Gives models created in an `IPUStrategy` scope their IPU extension class.

Every Keras model, whatever its kind, is created through `Model.__new__`.
While a strategy scope is active, the hook below swaps the new instance's
class for a subclass that puts the matching extension first in the MRO, so
the extension's `fit`, `evaluate` and `predict` win. The dynamic class hides
behind a `__class__` property so that Keras serialization records the
user's class, and pickling goes through the base class.
"""

from __future__ import annotations

import functools
from typing import Any

from keras.src.models import model as keras_model_module
from keras.src.models.functional import Functional
from keras.src.models.model import Model, functional_init_arguments
from keras.src.models.sequential import Sequential

from keras_ipu.keras import extensions
from keras_ipu.keras.strategy import IPUStrategy, current_strategy

# First match wins: a Functional-constructed Model subclass is Functional.
_EXTENSION_FOR = (
    (Sequential, extensions.SequentialExtension),
    (Functional, extensions.FunctionalExtension),
    (Model, extensions.ModelExtension),
)

_original_new = None
_OBJECT_CLASS_SLOT = object.__dict__["__class__"]


def install() -> None:
    """Installs the `Model.__new__` hook (idempotent)."""
    global _original_new
    if _original_new is not None:
        return
    _original_new = Model.__dict__["__new__"]
    Model.__new__ = staticmethod(_new_model)
    # PipelineStage scopes record stages on the layers and calls they see.
    from keras_ipu.keras import pipeline_stage

    pipeline_stage.install()


def uninstall() -> None:
    """Removes the hook; models created afterwards stay plain."""
    global _original_new
    if _original_new is None:
        return
    Model.__new__ = _original_new
    _original_new = None
_OBJECT_CLASS_SLOT = object.__dict__["__class__"]


def _new_model(cls, *args, **kwargs):
    obj = _original_new.__func__(cls, *args, **kwargs)
    strategy = current_strategy()
    if (
        strategy is None
        or not strategy.enable_keras_extensions
        or isinstance(obj, extensions.ExtensionBase)
    ):
        return obj
    functional = functional_init_arguments(args, kwargs)
    set_class(obj, extension_class(type(obj), functional))
    # Plain dict write: Keras' attribute tracking is not set up yet.
    vars(obj)["_ipu_strategy"] = strategy
    return obj


def set_class(obj: Any, cls: type) -> None:
    """Sets the real type of `obj`, bypassing the `__class__` property."""
    _OBJECT_CLASS_SLOT.__set__(obj, cls)


def extension_for(cls: type, functional: bool = False) -> type:
    """The extension class for a model class (`functional`: built from inputs/outputs)."""
    if functional and not issubclass(cls, Sequential):
        return extensions.FunctionalExtension
    return next(ext for base, ext in _EXTENSION_FOR if issubclass(cls, base))


@functools.cache
def extension_class(cls: type, functional: bool = False) -> type:
    """The dynamic class `(Extension, cls)` used for IPU instances of `cls`."""
    extension = extension_for(cls, functional)
    return type(
        cls.__name__,
        (extension, cls),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_ipu_base_class": cls,
            # Keras serialization records obj.__class__: show the user's class.
            "__class__": property(lambda self: type(self)._ipu_base_class),
        },
    )


def unpickle_model(buffer: Any, enable_keras_extensions: bool = True) -> Model:
    """Loads a pickled IPU model back inside a new `IPUStrategy` scope."""
    with IPUStrategy(enable_keras_extensions=enable_keras_extensions).scope():
        return keras_model_module.Model._unpickle_model(buffer)
