"""Keras layers that Keras runs eagerly, made to compile where keras_ipu compiles them.

Keras runs a model's step eagerly when a layer says `supports_jit=False`;
an IPU program is always compiled (IPU TensorFlow compiled these layers with
XLA). Most such layers trace as they are; `RandomCrop` slices its images at
offsets it draws, which a traced program cannot do with Python slices. Its
crop here takes the same offsets with `jax.lax.dynamic_slice`, so the
numbers are those of Keras' eager crop; outside a trace Keras' own code runs.
"""

from __future__ import annotations

from typing import Any

import jax
import keras

_CROP = keras.layers.RandomCrop


def install() -> None:
    """Lets `keras.layers.RandomCrop` crop inside a compiled program (once per process).

    Example:

    >>> install()
    """
    if getattr(_CROP.transform_images, "_keras_ipu_traceable", False):
        return
    eager = _CROP.transform_images

    def transform_images(self, images, transformation, training=True):
        if not (training and _traced(transformation)):
            return eager(self, images, transformation, training=training)
        return _dynamic_crop(self, self.backend.cast(images, self.compute_dtype), transformation)

    transform_images.__doc__ = eager.__doc__
    transform_images._keras_ipu_traceable = True
    _CROP.transform_images = transform_images


def _traced(transformation: Any) -> bool:
    return any(isinstance(offset, jax.core.Tracer) for offset in transformation)


def _dynamic_crop(layer: Any, images: Any, transformation: Any) -> Any:
    """`images` cropped to the layer's size at the drawn `(top, left)` offsets."""
    top, left = transformation
    channels_last = layer.data_format == "channels_last"
    height_axis, width_axis = (-3, -2) if channels_last else (-2, -1)
    starts = [0] * images.ndim
    sizes = list(images.shape)
    starts[height_axis], starts[width_axis] = top, left
    sizes[height_axis], sizes[width_axis] = layer.height, layer.width
    return jax.lax.dynamic_slice(images, starts, sizes)
