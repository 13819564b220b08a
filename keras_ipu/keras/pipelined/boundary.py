"""What crosses a pipeline stage boundary: each sample's tensors as float32 rows, with their masks.

A stage sends the next a bundle `[batch + 1, width]` (`PipelinedModel.bundle_shape`):
row `i < batch` holds sample `i`'s tensors flattened, each followed by the
Keras mask it carries; these functions write and read one tensor's part.
How many values a tensor takes is its `Sample`: the per-sample shapes of its
values and mask, from the graph, or for an axis the graph leaves `None`
(a sequence's length) from the inputs the program is built for
(`pipelined.samples`).

Example:

```python
sample = samples[key]                                          # a tensor's `Sample`
parts = send(value, batch, tensor, stage, sample)             # the sender's rows
value, offset = receive(bundle[:-1], offset, tensor, sample)  # the receiver's tensor
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.backend.common import masking


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample's part of a tensor: the shapes of its values and of its Keras mask.

    Args:
        shape: The tensor's shape without the batch axis.
        mask: The mask's shape without the batch axis (`None`: no mask).
        dtype: The type its values have when the layers run (`None`: the
            graph tensor's). Keras types a layer's graph output by the
            layer's compute dtype unless the layer says otherwise: a
            `Lambda` returning integers is float32 in the graph.

    Example:

    >>> Sample((6, 4), (6,)).width   # 24 values, 6 of mask
    30
    """

    shape: tuple[int, ...]
    mask: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def values(self) -> int:
        """Values per sample of the tensor (its mask's not included)."""
        return int(np.prod(self.shape))

    @property
    def width(self) -> int:
        """Values per sample the tensor takes in the bundle, its mask's included."""
        return self.values + (0 if self.mask is None else int(np.prod(self.mask)))


def receive(rows, offset: int, tensor, sample: Sample) -> tuple:
    """The tensor at `offset` of a bundle's sample rows, its mask set on it; the next offset.

    Args:
        rows: The bundle's sample rows, `[batch, width]`.
        offset: Where the tensor's values start in a row.
        tensor: The graph's tensor (its dtype, whether it carries a mask).
        sample: The tensor's `Sample` for this program's inputs.

    Returns:
        `(value, offset after the tensor and its mask)`.

    Example:

    >>> value, offset = receive(bundle[:-1], 0, tensor, samples[key])
    """
    value = from_bundle(rows[:, offset:offset + sample.values].reshape((-1, *sample.shape)),
                        sample.dtype or tensor.dtype)
    offset += sample.values
    if symbolic_mask(tensor) is not None:  # the mask Keras layers find on the tensor, as sent
        size = int(np.prod(sample.mask))
        sent = rows[:, offset:offset + size].reshape((-1, *sample.mask))
        masking.set_keras_mask(value, jax.lax.stop_gradient(sent) > 0.5)
        offset += size
    return value, offset


def symbolic_mask(tensor):
    """The Keras mask the graph's tensor carries (`Masking`, `Embedding(mask_zero=True)`).

    Example:

    >>> symbolic_mask(keras.layers.Masking()(keras.Input((6, 4)))).shape
    (None, 6)
    """
    return masking.get_keras_mask(tensor)


def send(value, batch: int, tensor, stage: int, sample: Sample) -> list:
    """A tensor's bundle rows, then its mask's where the graph's tensor has one.

    Keras layers find a mask on the tensor itself (a `Dense` passes it on, a
    `MultiHeadAttention` reads it, the loss masks with it): it crosses with it.

    Args:
        value: The tensor's value, the batch first.
        batch: The micro-batch's samples.
        tensor: The graph's tensor.
        stage: The sending stage (for errors).
        sample: The tensor's `Sample` for this program's inputs.

    Returns:
        The `[batch, values]` float32 parts: the tensor's, then its mask's.

    Raises:
        ValueError: As `to_bundle`.
    """
    parts = [to_bundle(value, batch, tensor, stage, sample.dtype or tensor.dtype)]
    if symbolic_mask(tensor) is not None:
        sent = carried_mask(value, batch, sample.mask)
        parts.append(jnp.reshape(sent, (batch, -1)).astype(jnp.float32))
    return parts


def carried_mask(value, batch: int, shape) -> Any:
    """The Keras mask on `value`, or all True (`[batch, *shape]`) where nothing was masked.

    Example:

    >>> carried_mask(keras.ops.ones((2, 6, 4)), 2, (6,)).shape
    (2, 6)
    """
    mask = masking.get_keras_mask(value)
    return jnp.ones((batch, *shape), bool) if mask is None else mask


def to_bundle(value, batch: int, tensor, stage: int, dtype=None):
    """A tensor a stage sends on, as `[batch, values]` float32 rows of the bundle.

    32-bit integers travel as their bits (a float32 cast would round those
    above 2**24); narrower types are exact in float32. A tensor goes in
    `dtype` (its `Sample`'s: the type the layers give it), as the receiving
    stage reads it.

    Raises:
        ValueError: For a tensor without the batch as its first axis.
    """
    check_batched(value.shape, batch, tensor, stage)
    flat = value.reshape(batch, -1).astype(dtype or tensor.dtype)
    if _sent_as_bits(flat.dtype):
        return jax.lax.bitcast_convert_type(flat, jnp.float32)
    return flat.astype(jnp.float32)


def check_batched(shape: tuple, batch: int, tensor, stage: int) -> None:
    """Refuses a tensor crossing stages without the batch as its first axis.

    Raises:
        ValueError: Naming the tensor, its shape and the batch.

    Example:

    >>> check_batched((4, 8), 4, tensor, stage=0)   # fine: the batch comes first
    """
    if not len(shape) or shape[0] != batch:
        name = getattr(tensor, "name", None) or "a tensor"
        raise ValueError(
            f"Pipeline stage {stage} sends {name} of shape {tuple(shape)} to a later "
            f"stage, but a stage sends each sample's values: tensors crossing stages need the "
            f"batch ({batch} samples) as their first axis. Compute it in the stage that uses "
            f"it, or keep the batch axis.")


def from_bundle(value, dtype):
    """The inverse of `to_bundle` (integers carry no gradient)."""
    dtype = jnp.dtype(dtype)
    if _sent_as_bits(dtype):
        return jax.lax.bitcast_convert_type(jax.lax.stop_gradient(value), dtype)
    return value.astype(dtype)


def _sent_as_bits(dtype) -> bool:
    return dtype.itemsize == 4 and dtype != jnp.float32
