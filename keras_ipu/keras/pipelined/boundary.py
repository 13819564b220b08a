"""What crosses a pipeline stage boundary: each sample's tensors as rows, with their masks.

A stage sends the next a bundle `[batch + 1, width]` (`PipelinedModel.bundle`):
row `i < batch` holds sample `i`'s tensors flattened, each followed by the
Keras mask it carries; these functions write and read one tensor's part.
The last row carries the additional losses of the stages so far
(`carry_loss`). A bundle is float32, or the 16-bit float type of every
tensor it carries (a mixed precision model's activations), as an IPU sends
them (`bundle_dtype`).
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
import functools
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
    if sample.mask is not None:  # the mask Keras layers find on the tensor, as sent
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


def bundle_dtype(dtypes) -> np.dtype:
    """The type of a bundle carrying tensors of `dtypes`: float32, or their 16-bit float type.

    A bundle of 16-bit values halves what crosses the boundary, and the
    activations' gradients are computed in that type in plain Keras too. It
    needs every tensor in that one type (bool values and masks are exact in
    it); anything else crosses as float32 (32-bit integers as their bits).

    Example:

    >>> bundle_dtype(["float16", "bool"]), bundle_dtype(["float16", "int32"])
    (dtype('float16'), dtype('float32'))
    """
    kinds = {jnp.dtype(dtype) for dtype in dtypes} - {jnp.dtype(bool)}
    if len(kinds) == 1 and kinds <= {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}:
        return kinds.pop()
    return jnp.dtype(jnp.float32)


# A 16-bit bundle carries the float32 loss's bits as 8-bit whole numbers, exact in
# float16 and bfloat16 (its bits as two 16-bit values could be NaN patterns, which
# XLA:CPU may rewrite); the loss's gradient comes back in the same form.
_LOSS_BYTES = (24, 16, 8, 0)
LOSS_WIDTH = {jnp.dtype(jnp.float32): 1, jnp.dtype(jnp.float16): len(_LOSS_BYTES),
              jnp.dtype(jnp.bfloat16): len(_LOSS_BYTES)}


def _as_bytes(value, width: int, dtype) -> Any:
    """`[width]` of `dtype`: a float32 scalar's bits as whole numbers 0-255, then zeros."""
    bits = jax.lax.bitcast_convert_type(value.astype(jnp.float32), jnp.uint32)
    parts = jnp.stack([(bits >> shift) & 0xFF for shift in _LOSS_BYTES]).astype(dtype)
    return jnp.zeros((width,), dtype).at[:len(_LOSS_BYTES)].set(parts)


def _from_bytes(row) -> Any:
    """The float32 scalar `_as_bytes` wrote in `row`."""
    parts = row[:len(_LOSS_BYTES)].astype(jnp.uint32)
    bits = functools.reduce(jnp.bitwise_or, [parts[i] << shift
                                             for i, shift in enumerate(_LOSS_BYTES)])
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# The gradient crosses back as bytes too: a loss scale (2**16 and more) is past float16's
# largest value, and bfloat16 would round a `loss_scale_factor` of 1e4 to 9,984.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sent_loss(loss, width: int, dtype) -> Any:
    return _as_bytes(loss, width, dtype)


def _sent_loss_forward(loss, width, dtype):
    return _as_bytes(loss, width, dtype), None


def _sent_loss_backward(width, dtype, _, row_gradient):
    return (_from_bytes(row_gradient),)


_sent_loss.defvjp(_sent_loss_forward, _sent_loss_backward)


@jax.custom_vjp
def _received_loss(row) -> Any:
    return _from_bytes(row)


def _received_loss_forward(row):
    return _from_bytes(row), jnp.zeros((0,), row.dtype)


def _received_loss_backward(empty, gradient):
    return (_as_bytes(gradient, LOSS_WIDTH[empty.dtype], empty.dtype),)


_received_loss.defvjp(_received_loss_forward, _received_loss_backward)


def carry_loss(loss, width: int, dtype) -> Any:
    """The bundle's last row: the additional loss so far, exactly, with its gradient.

    A float32 bundle holds it in its first value. A 16-bit one holds its
    float32 bits as four bytes, each a whole number (rounding the loss to 16
    bits would change the logged loss), and its gradient crosses back as the
    same four bytes.

    Args:
        loss: The float32 scalar.
        width: The bundle's width (at least `LOSS_WIDTH[dtype]`).
        dtype: The bundle's type.

    Returns:
        `[1, width]` of `dtype`; `carried_loss` reads it back.

    Example:

    >>> carried_loss(carry_loss(jnp.float32(0.1), 8, jnp.float16))
    Array(0.1, dtype=float32)
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jnp.zeros((1, width), dtype).at[0, 0].set(loss)
    return _sent_loss(loss, width, dtype)[None]


def carried_loss(bundle) -> Any:
    """The additional loss a bundle's last row carries (see `carry_loss`), float32.

    Example:

    >>> carried_loss(jnp.zeros((5, 8)))
    Array(0., dtype=float32)
    """
    if bundle.dtype == jnp.float32:
        return bundle[-1, 0]
    return _received_loss(bundle[-1, :len(_LOSS_BYTES)])


def send(value, batch: int, tensor, stage: int, sample: Sample,
         dtype=jnp.float32) -> list:
    """A tensor's bundle rows, then its mask's where it carries one (`sample.mask`).

    Keras layers find a mask on the tensor itself (a `Dense` passes it on, a
    `MultiHeadAttention` reads it, the loss masks with it): it crosses with it.

    Args:
        value: The tensor's value, the batch first.
        batch: The micro-batch's samples.
        tensor: The graph's tensor.
        stage: The sending stage (for errors).
        sample: The tensor's `Sample` for this program's inputs.
        dtype: The bundle's type (`bundle_dtype`).

    Returns:
        The `[batch, values]` parts of `dtype`: the tensor's, then its mask's.

    Raises:
        ValueError: As `to_bundle`.
    """
    parts = [to_bundle(value, batch, tensor, stage, sample.dtype or tensor.dtype, dtype)]
    if sample.mask is not None:
        sent = carried_mask(value, batch, sample.mask)
        parts.append(jnp.reshape(sent, (batch, -1)).astype(dtype))
    return parts


def carried_mask(value, batch: int, shape) -> Any:
    """The Keras mask on `value`, or all True (`[batch, *shape]`) where nothing was masked.

    Example:

    >>> carried_mask(keras.ops.ones((2, 6, 4)), 2, (6,)).shape
    (2, 6)
    """
    mask = masking.get_keras_mask(value)
    return jnp.ones((batch, *shape), bool) if mask is None else mask


def to_bundle(value, batch: int, tensor, stage: int, dtype=None, bundle=jnp.float32):
    """A tensor a stage sends on, as `[batch, values]` rows of a bundle of type `bundle`.

    In a float32 bundle 32-bit integers travel as their bits (a float32 cast
    would round those above 2**24); narrower types are exact in float32. A
    16-bit bundle carries only its own type and bools (`bundle_dtype`). A
    tensor goes in `dtype` (its `Sample`'s: the type the layers give it), as
    the receiving stage reads it.

    Raises:
        ValueError: For a tensor without the batch as its first axis.
    """
    check_batched(value.shape, batch, tensor, stage)
    flat = value.reshape(batch, -1).astype(dtype or tensor.dtype)
    if _sent_as_bits(flat.dtype):
        return jax.lax.bitcast_convert_type(flat, jnp.float32)
    return flat.astype(bundle)


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
