"""What crosses a pipeline stage boundary: each sample's tensors as float32 rows, with their masks.

A stage sends the next a bundle `[batch + 1, width]` (`PipelinedModel.bundle_shape`):
row `i < batch` holds sample `i`'s tensors flattened, each followed by the
Keras mask it carries; these functions write and read one tensor's part.

Example:

```python
parts = send(value, batch, tensor, stage)             # the sender's rows
value, offset = receive(bundle[:-1], offset, tensor)  # the receiver's tensor
```
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.backend.common import masking


def width(tensor) -> int:
    """Values per sample a graph tensor takes in the bundle (its mask's included).

    Example:

    >>> width(keras.layers.Masking()(keras.Input((6, 4))))   # 24 values, 6 of mask
    30
    """
    return _values_per_sample(tensor) + _values_per_sample(symbolic_mask(tensor))


def receive(rows, offset: int, tensor) -> tuple:
    """The tensor at `offset` of a bundle's sample rows, its mask set on it; the next offset.

    Example:

    >>> value, offset = receive(bundle[:-1], 0, tensor)
    """
    size = _values_per_sample(tensor)
    value = from_bundle(rows[:, offset:offset + size].reshape((-1, *tensor.shape[1:])),
                        tensor.dtype)
    offset += size
    mask = symbolic_mask(tensor)
    if mask is not None:  # the mask Keras layers find on the tensor, as sent
        size = _values_per_sample(mask)
        sent = rows[:, offset:offset + size].reshape((-1, *mask.shape[1:]))
        masking.set_keras_mask(value, jax.lax.stop_gradient(sent) > 0.5)
        offset += size
    return value, offset


def _values_per_sample(tensor) -> int:
    return 0 if tensor is None else int(np.prod(tensor.shape[1:]))


def symbolic_mask(tensor):
    """The Keras mask the graph's tensor carries (`Masking`, `Embedding(mask_zero=True)`).

    Example:

    >>> symbolic_mask(keras.layers.Masking()(keras.Input((6, 4)))).shape
    (None, 6)
    """
    return masking.get_keras_mask(tensor)


def send(value, batch: int, tensor, stage: int) -> list:
    """A tensor's bundle rows, then its mask's where the graph's tensor has one.

    Keras layers find a mask on the tensor itself (a `Dense` passes it on, a
    `MultiHeadAttention` reads it, the loss masks with it): it crosses with it.
    """
    parts = [to_bundle(value, batch, tensor, stage)]
    mask = symbolic_mask(tensor)
    if mask is not None:
        sent = masking.get_keras_mask(value)
        if sent is None:  # nothing masked
            sent = jnp.ones((batch, *mask.shape[1:]), jnp.float32)
        parts.append(jnp.reshape(sent, (batch, -1)).astype(jnp.float32))
    return parts


def to_bundle(value, batch: int, tensor, stage: int):
    """A tensor a stage sends on, as `[batch, values]` float32 rows of the bundle.

    32-bit integers travel as their bits (a float32 cast would round those
    above 2**24); narrower types are exact in float32. A tensor goes in the
    type of the graph's tensor (a `Lambda`'s output is float32 there,
    whatever its function returns), as the receiving stage reads it.

    Raises:
        ValueError: For a tensor without the batch as its first axis.
    """
    if value.ndim == 0 or value.shape[0] != batch:
        name = getattr(tensor, "name", None) or "a tensor"
        raise ValueError(
            f"Pipeline stage {stage} sends {name} of shape {tuple(value.shape)} to a later "
            f"stage, but a stage sends each sample's values: tensors crossing stages need the "
            f"batch ({batch} samples) as their first axis. Compute it in the stage that uses "
            f"it, or keep the batch axis.")
    # In the type the receiving stage expects: the graph's (Keras' symbolic type).
    flat = value.reshape(batch, -1).astype(tensor.dtype)
    if _sent_as_bits(flat.dtype):
        return jax.lax.bitcast_convert_type(flat, jnp.float32)
    return flat.astype(jnp.float32)


def from_bundle(value, dtype):
    """The inverse of `to_bundle` (integers carry no gradient)."""
    dtype = jnp.dtype(dtype)
    if _sent_as_bits(dtype):
        return jax.lax.bitcast_convert_type(jax.lax.stop_gradient(value), dtype)
    return value.astype(dtype)


def _sent_as_bits(dtype) -> bool:
    return dtype.itemsize == 4 and dtype != jnp.float32
