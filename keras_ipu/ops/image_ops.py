"""`tensorflow.python.ipu.image_ops`: image normalisation, on JAX arrays.

Example:

```python
from keras_ipu.ops import image_ops

images = image_ops.normalise_image(images, [0.485, 0.456, 0.406], [1 / 0.229] * 3, 1 / 255)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def normalise_image(image: Any, channel_offsets: Any, channel_scales: Any, scale: float = 1,
                    name: str | None = None) -> jax.Array:
    """`(image * scale - channel_offsets) * channel_scales`, padded to 4 channels.

    Args:
        image: `[..., 3]`, channels innermost; uint8, float16 or float32.
        channel_offsets: The 3 channels' offsets.
        channel_scales: The 3 channels' scales.
        scale: Applied to the image first.
        name: Accepted for compatibility.

    Returns:
        `[..., 4]`, the fourth channel zeros; of the image's type, except
        float16 for uint8 images.

    Raises:
        ValueError: For an image that does not have 3 channels, or another
            dtype; for offsets or scales that are not 3 values.
        TypeError: For a `scale` that is not a number.

    Example:

    >>> normalise_image(np.full((1, 2, 2, 3), 255, "uint8"), [0, 0, 0], [1, 1, 1], 1 / 255)
    """
    image = jnp.asarray(image)
    if image.shape[-1:] != (3,):
        raise ValueError(f"normalise_image needs 3 channels innermost, got shape {image.shape}.")
    out_dtype = {jnp.dtype("uint8"): jnp.float16, jnp.dtype("float16"): jnp.float16,
                 jnp.dtype("float32"): jnp.float32}.get(image.dtype)
    if out_dtype is None:
        raise ValueError(f"normalise_image takes uint8, float16 or float32 images, "
                         f"got {image.dtype}.")
    offsets = jnp.asarray(channel_offsets, out_dtype)
    scales = jnp.asarray(channel_scales, out_dtype)
    for argument, values in (("channel_offsets", offsets), ("channel_scales", scales)):
        if values.shape != (3,):  # one value would apply to every channel unasked
            raise ValueError(f"normalise_image's {argument} must be a [3] array (one value "
                             f"per channel), got shape {values.shape}.")
    if isinstance(scale, (str, bool)) or scale is None or np.ndim(scale):
        raise TypeError(f"normalise_image's scale must be a number, got {scale!r}.")
    normalised = (image.astype(out_dtype) * jnp.asarray(scale, out_dtype) - offsets) * scales
    return jnp.pad(normalised, [(0, 0)] * (image.ndim - 1) + [(0, 1)])


__all__ = ["normalise_image"]
